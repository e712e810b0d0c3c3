"""trace/tokentypes.py: a `segment_ids` argument the called model embeds as token types (BERT's token_type_ids under
another name) is kept as token_type_ids, not read as packed documents; a segment_ids the model embeds nowhere, or whose
values outrun its token-type embedding, stays documents."""

from __future__ import annotations

import json

import numpy as np
import torch

import maskcli
from checkbugs import runner
from maskcli.commands import app
from maskcli.trace.tokentypes import token_types


class _Bert(torch.nn.Module):
    """A two-segment encoder: token and token-type embeddings, one layer of SDPA over the real tokens (both ways)."""

    def __init__(self, types=2, name="token_type_embeddings"):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(10, 8)
        setattr(self, name, torch.nn.Embedding(types, 8))
        self.name = name

    def forward(self, token_ids, segment_ids, attention_mask):
        types = segment_ids if getattr(self, self.name).num_embeddings > 1 else torch.zeros_like(segment_ids)
        x = self.word_embeddings(token_ids) + getattr(self, self.name)(types)  # (RoBERTa's one type: zeros)
        q = x[:, None]  # (B, 1, L, 8)
        keep = attention_mask[:, None, None, :].bool()
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=keep)


def _codes(model, segments):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 0, 0]])
    real = (ids != 0).long()
    with maskcli.trace() as t, torch.no_grad():
        model(ids, torch.tensor(segments), real)
    return {f.code for group in t.groups() for f in group.findings}, t


def test_segments_a_model_embeds_as_token_types_are_no_documents():
    # a cross-encoder: context (segment 0) then candidate (segment 1), attending each other as BERT's segments do
    segments = [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    codes, _ = _codes(_Bert(), segments)
    assert "varlen-leak" not in codes
    codes, _ = _codes(_Bert(name="segment_embedding"), segments)  # (UniLM's and others' name for it)
    assert "varlen-leak" not in codes


def test_segments_no_embedding_takes_stay_documents():
    # packed documents beside RoBERTa's one token type (type_vocab_size=1, every token's type 0): ids its token-type
    # embedding has no row for are documents; and a model that embeds no token types at all reads any segment_ids so
    codes, _ = _codes(_Bert(types=1), [[1, 1, 2, 2, 3, 3], [1, 1, 1, 2, 0, 0]])
    assert "varlen-leak" in codes
    codes, _ = _codes(_Bert(types=2, name="position_embeddings"), [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    assert "varlen-leak" in codes


def test_token_types_keeps_what_was_said_otherwise():
    model, segments = _Bert(), np.array([[0, 1]])
    assert token_types(model, {"segment_ids": segments}).keys() == {"token_type_ids"}
    both = {"segment_ids": segments, "token_type_ids": segments}  # both named: each kept as it was
    assert token_types(model, both) is both
    held = {"segment_ids": segments, "segments_held_by": "mask"}  # (Levanter's AttentionMask field: documents)
    assert token_types(model, held) is held
    assert token_types(torch.nn.Linear(2, 2), {"segment_ids": segments}).keys() == {"segment_ids"}


def test_parlai_cross_encoder_segments_are_not_documents(tmp_path):
    """facebookresearch/ParlAI#1949 (written blind, batch blind-fy): BertWrapper(token_ids, segment_ids, mask) hands
    segment_ids to BERT's token_type_ids; both runs were told varlen-leak (context and candidate read as two documents).
    The bug itself (the candidate's positions shifted by the context's padding) leaves the mask as it was: both runs quiet."""
    from pathlib import Path

    program = Path(__file__).parent / "data" / "blind" / "parlai_bert_cross_encoder_candidate_after_context_padding.py"
    for args in ((), ("--fixed",)):
        out = tmp_path / "t.json"
        result = runner.invoke(app, ["trace", "--json", str(out), str(program), *args])
        found = [f for g in json.loads(out.read_text())["groups"] for f in g["findings"]]
        assert result.exit_code == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], result.output
