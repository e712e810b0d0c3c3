"""checks/heldlengths.py (held-documents-leak, the documents by the lengths a batch dict holds; trace/held.py's
batch_lengths): caught in the published bug's reproduction (tests/data/bugs) and in a program written another way
(tests/data/heldlengths), quiet on both fixes; the flagged cells against a double loop over documents."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from checkbugs import check_bug
from maskcli.checks import eachheld, heldlengths
from maskcli.trace.held import _entries, split_top

HELDLENGTHS = Path(__file__).parent / "data" / "heldlengths"


def test_verl_peagle_cod_documents_from_the_all_ones_attention_mask_is_found(tmp_path):
    # verl-project/verl-SpeCo#18 (fix 0acc2a0): the COD mask's document lengths were attention_mask[b].sum() of the
    # flat packed batch (one document); the fix hands base_trainer's per-chunk seq_lengths on
    found = check_bug(tmp_path, "verl_speco_peagle_cod_mask_documents_from_all_ones_attention_mask", "held-documents-leak")
    assert len(found) == 1
    assert 'batch["seq_lengths"] [10, 14]' in found[0]["message"]
    assert tuple(found[0]["cell"]) == (0, 10, 0)  # document 1's first token sees document 0's first


def test_packed_sft_doc_lens_never_reaching_the_mask_is_found(tmp_path):
    found = check_bug(tmp_path, "packed_sft_doc_lens_in_batch_dict_causal_only", "held-documents-leak",
                      folder=HELDLENGTHS)
    assert tuple(found[0]["cell"]) == (0, 5, 0) and 'inputs["doc_lens"] [5, 4, 6]' in found[0]["message"]


def _run(cells, lengths, positions=None):
    call = SimpleNamespace(stored=cells, shape=cells.shape, mask=0, details={
        "batch_lengths": [{"kind": "batch_lengths", "name": 'batch["seq_lengths"]', "where": "f()",
                           "rows": np.array(lengths)}], **({"held_positions": [{"rows": positions}]} if positions is
                                                          not None else {})})
    return SimpleNamespace(calls=[call], top=lambda call: None)


def test_by_lengths_against_a_double_loop(monkeypatch):
    monkeypatch.setattr(heldlengths, "keep", lambda call: call.stored)
    monkeypatch.setattr(eachheld, "cross", lambda call: False)
    lengths, extra = [3, 5, 2], 4  # 10 packed tokens, then 4 deeper samples at positions that go down
    t = sum(lengths) + extra
    doc = [d for d, n in enumerate(lengths) for _ in range(n)]
    positions = np.concatenate([np.arange(10), [2, 5, 6, 8]])[None]
    causal = np.tril(np.ones((t, t), dtype=bool))[None, None]
    documents = causal.copy()
    for i in range(10):
        for j in range(10):
            documents[0, 0, i, j] &= doc[i] == doc[j]
    assert heldlengths.by_lengths(_run(documents, lengths, positions)) == []
    (call, finding), = heldlengths.by_lengths(_run(causal, lengths, positions))
    across = sum(1 for i in range(10) for j in range(i + 1) if doc[i] != doc[j])
    assert f"({across} such cells)" in finding.message and finding.cell == (0, 3, 0)
    # positions that do not count up over the lengths' tokens: not these documents
    assert heldlengths.by_lengths(_run(causal, lengths, positions[:, ::-1].copy())) == []


def test_a_batch_dicts_lengths_are_held_apart_from_the_padding():
    batch = {"seq_lengths": torch.tensor([10, 14]), "attention_mask": torch.ones(1, 24, dtype=torch.long)}
    details = {"held_padding": _entries("batch", batch, test_a_batch_dicts_lengths_are_held_apart_from_the_padding.__code__,
                                        set())}
    split_top(details)
    assert [h["name"] for h in details["batch_lengths"]] == ['batch["seq_lengths"]']
    assert details["batch_lengths"][0]["rows"].tolist() == [10, 14]
    assert [h["kind"] for h in details["held_padding"]] == ["keep"]
