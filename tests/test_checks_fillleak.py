"""checks/fillleak.py and trace/fillleak.py: a float attn_mask whose finite fill the scores outgrow, caught in the
published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/fills), quiet on both
fixes; the flagged cell against a double loop over positions, the leaked weight against an eager softmax."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug
from maskcli.trace.fillleak import LEAK, fill_leak

FILLS = Path(__file__).parent / "data" / "fills"


def test_gpt_neox_kv_cache_masked_score_minus_1e4_is_found(tmp_path):
    # NVIDIA/TensorRT-Model-Connect#695 (written blind, batch blind-cr): kMaskedScore = -1e4 in the batched prefill
    # mask over 24 cache slots (none valid yet) and the 10 new tokens, beside Pythia-scale logits
    found = check_bug(tmp_path, "trtmc_gpt_neox_kv_cache_masked_score_minus_1e4_leaks", "fill-leaks")
    max_length, valid = 24, 0
    for hit in found:
        _, q, k = hit["cell"]
        seen = k < valid or max_length <= k <= max_length + q  # (the runtime's own rule, as a double loop reads it)
        assert not seen, hit
        assert "-10000" in hit["message"]
    assert {f["message"].split("'")[0] for f in found} == {"layers.0", "layers.1"}


def test_an_encoder_whose_pad_keys_get_bert_minus_1e4_beside_massive_activations_is_found(tmp_path):
    found = check_bug(tmp_path, "outlier_encoder_pad_mask_minus_1e4_leaks", "fill-leaks", folder=FILLS)
    lengths, width = (5, 8), 8
    for hit in found:
        b, q, k = hit["cell"]
        assert q >= width - lengths[b] and k < width - lengths[b], hit  # (a real query, a left pad key)


def _weights(q, k, mask, scale):
    return torch.softmax(q @ k.transpose(-1, -2) * scale + mask, -1)


def test_the_leaked_weight_is_the_eager_softmax_one_and_ordinary_or_deep_fills_are_quiet():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8)
    keep = torch.ones(5, 7, dtype=torch.bool).tril(2)
    scale = 8 ** -0.5
    for fill in (-1e4, -1e9, float("-inf"), torch.finfo(torch.float32).min):  # ordinary scores: no fill leaks
        assert fill_leak(q, k, torch.zeros(5, 7).masked_fill(~keep, fill), None, False) == {}
    big = q * 300, k * 300  # (scores thousands apart)
    mask = torch.zeros(5, 7).masked_fill(~keep, -1e4)
    found = fill_leak(*big, mask, None, False)["fill_leak"]
    weights = _weights(*big, mask, scale)
    on_masked = (weights * ~keep).sum(-1)  # (B, H, Lq)
    assert (found["rows"] == (on_masked >= LEAK).any(1).numpy()).all()
    assert torch.allclose(torch.from_numpy(found["weight"]), on_masked.amax(1), atol=1e-5)
    for b, row in enumerate(found["key"]):
        for i, key in enumerate(row):
            if found["rows"][b, i]:
                assert not keep[i, key]  # (the key it names is one the mask lowers)
    assert fill_leak(*big, torch.zeros(5, 7).masked_fill(~keep, -1e9), None, False) == {}
    assert fill_leak(*big, torch.zeros(5, 7).masked_fill(~keep, float("-inf")), None, False) == {}
