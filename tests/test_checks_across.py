"""checks/across.py: a call a module states is cross-attention, masked as a causal triangle over the memory."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from checkbugs import check_bug, traced

HELD = Path(__file__).parent / "data" / "held"


def test_transformer_engine_inter_attention_causal(tmp_path):
    """TransformerEngine#565: the inter-attention (attention_type="cross") called with the self-attention's "causal"."""
    check_bug(tmp_path, "transformer_engine_decoder_cross_attention_causal_mask_type", "cross-attention-causal")


def test_is_cross_attention_with_is_causal(tmp_path):
    """Written another way: BERT's `is_cross_attention=True`, SDPA's is_causal handed on; the cells hidden are those
    torch.tril hides."""
    import torch

    status, found, report = traced(tmp_path, "cross_attention_is_causal", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "cross-attention-causal")
    hidden = int((~torch.ones(5, 5, dtype=torch.bool).tril()).sum())
    assert f"({hidden} cells of later memory hidden)" in hit["message"]
    assert "is_cross_attention=True" in hit["source"]
    status, found, report = traced(tmp_path, "cross_attention_is_causal", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_flamingo_text_over_media_latents_is_cross_attention_and_quiet(tmp_path):
    """OpenFlamingo's MaskedCrossAttention: 9 text queries over 24 media latents, each text token seeing only its
    latest image's latents. Fewer queries than keys, yet a cross-attention (its class; `gated_xattn` its path): no
    query is placed among the keys, so no sees-later; with either word renamed away, still quiet (the `media` argument
    handed to the function attending says it too: trace/crossing.py)."""
    folder = Path(__file__).parent / "data" / "quiet_blind"
    name = "flamingo_masked_cross_attention_media_locations"
    source = (folder / f"{name}.py").read_text()
    for old, new in ((None, None), ("gated_xattn", "gated_layer"), ("MaskedCrossAttention", "MaskedMediaAttention")):
        (tmp_path / f"{name}.py").write_text(source if old is None else source.replace(old, new))
        status, found, report = traced(tmp_path, name, False, tmp_path)
        assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    (tmp_path / f"{name}.py").write_text(source.replace("gated_xattn", "gated_layer")
                                         .replace("MaskedCrossAttention", "MaskedOtherAttention").replace("media", "stuff"))
    status, found, report = traced(tmp_path, name, False, tmp_path)  # nothing said: the keys outnumber the queries,
    call = json.loads((tmp_path / f"{name}.json").read_text())["calls"][1]  # and no word reads them another sequence's
    assert "cross" not in call["details"], call["details"]  # (what the three words end: read as any self-attention)


QUIET = Path(__file__).parent / "data" / "quiet"

WAITK = '''
import sys
import torch
import torch.nn.functional as F
from torch import nn

class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.is_cross_attention = True
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 16)
    def forward(self, hidden, encoder_out, mask):
        b, t, _ = hidden.shape
        q = self.q(hidden).view(b, t, 2, 4).transpose(1, 2)
        k, v = self.kv(encoder_out).view(b, encoder_out.shape[1], 2, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, 8)

class SimulMT(nn.Module):
    def __init__(self):
        super().__init__()
        self.cross = CrossAttention()
    def forward(self, tgt, encoder_out, wait_k):
        t, s = tgt.shape[1], encoder_out.shape[1]
        read = 1 if "--fixed" not in sys.argv else wait_k  # the bug: a wait-1 triangle under a stated wait-3
        return self.cross(tgt, encoder_out, torch.ones(t, s, dtype=torch.bool).tril(read - 1))

torch.manual_seed(0)
with torch.no_grad():
    SimulMT()(torch.randn(2, 5, 8), torch.randn(2, 5, 8), wait_k=3)
'''


def test_a_wait_k_policy_the_program_states_explains_the_triangle(tmp_path):
    """Wait-k simultaneous translation (fairseq's `waitk` in an argparse Namespace): with k = 1 the cross-attention's
    triangle is the stated policy, quiet; a wait-1 triangle under `wait_k=3` handed to the model call still contradicts
    it (its message names the policy), and the policy's own mask (query i reads keys 0..i + 2) is quiet."""
    import torch

    status, found, report = traced(tmp_path, "waitk_cross_attention_k1", False, QUIET)
    assert status == 0 and [f for f in found if f["code"] == "cross-attention-causal"] == [], report
    (tmp_path / "waitk_argument.py").write_text(WAITK)
    status, found, report = traced(tmp_path, "waitk_argument", False, tmp_path)
    hit = next(f for f in found if f["code"] == "cross-attention-causal")
    assert status == 1 and hit["severity"] == "wrong", report
    assert "wait_k=3 given to SimulMT" in hit["message"] and hit["expected"] == "query i reads keys 0..i + 2 (wait-3)"
    hidden = int((~torch.ones(5, 5, dtype=torch.bool).tril()).sum())
    assert f"({hidden} cells of later memory hidden)" in hit["message"]
    status, found, report = traced(tmp_path, "waitk_argument", True, tmp_path)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_cross_attention_handed_its_context_reads_no_decoder_padding_on_its_keys(tmp_path):
    """x-transformers b0715f2's fix: a cross-attention block given `context` and no `context_mask` attends to all of an
    unpadded context; the decoder's `mask` (its queries' padding) says nothing of those keys: no finding."""
    status, found, report = traced(tmp_path, "x_transformers_cross_attention_uses_decoder_mask_for_context", True)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


# the attending module's class name as its word that it is a cross-attention (trace/crossing.py's "class" reading),
# where no memory argument of the call's says otherwise; a class named causal too states its triangle

def test_transformers_mllama_text_cross_attention_causal_under_sdpa(tmp_path):
    """huggingface/transformers#48172: MllamaTextCrossAttention never sets is_causal, so SDPA runs is_causal=True over
    the text queries (written blind, batch blind-p; caught once the class name was read as the module's word, its path
    being that name too). Fix (is_causal = False, PR #48218) quiet: the 6 text queries see all 10 vision tokens."""
    pytest.importorskip("transformers")

    found = check_bug(tmp_path, "transformers_mllama_text_cross_attention_causal_under_sdpa", "cross-attention-causal")
    assert "(class MllamaTextCrossAttention)" in found[0]["message"]
    assert "(15 cells of later memory hidden)" in found[0]["message"]  # 6 * 5 / 2: the triangle above the diagonal


def test_a_hand_written_text_cross_attention_run_causal_is_found(tmp_path):
    """The same bug written otherwise: a hand-written `TextCrossAttention(x, cond)` whose SDPA line was copied from the
    self-attention with is_causal=True, as many text states as motion frames."""
    from checkbugs import caught

    hit = caught(tmp_path, "cross_attention_block_copied_is_causal", ("cross-attention-causal",))
    assert "(class TextCrossAttention)" in hit["message"] and "(21 cells of later memory hidden)" in hit["message"]


def test_transformer_engine_inter_attention_inherits_causal_window(tmp_path):
    """TransformerEngine#629: the self-attention's causal window (-1, 0) handed to the inter-attention beside its
    padding mask; 4 target queries over 10 source keys, the triangle aligned bottom-right (flash-attention's window)."""
    check_bug(tmp_path, "transformer_engine_decoder_cross_attention_inherits_causal_window", "cross-attention-causal")


def test_cache_causal_mask_reused_for_cross_attention_over_padded_memory(tmp_path):
    """Written another way: a cache-layout causal mask (`tril(diagonal=k_len - q_len)`) and the memory's padding handed
    to a module holding `is_cross_attention = True`; 3 queries over 7 keys, memory lengths 7 and 5. The cells counted
    hidden are the real memory keys past each query's bottom-right diagonal (a double loop), padding set aside."""
    folder = Path(__file__).parent / "data" / "across"
    name = "cached_decoder_cross_attention_reuses_cache_causal_mask"
    flagged = check_bug(tmp_path, name, "cross-attention-causal", folder)
    lengths, q_len, k_len = (7, 5), 3, 7
    hidden = sum(1 for n in lengths for i in range(q_len) for j in range(k_len) if j > i + k_len - q_len and j < n)
    assert f"({hidden} cells of later memory hidden)" in flagged[0]["message"]
    assert "is_cross_attention=True" in flagged[0]["source"]
