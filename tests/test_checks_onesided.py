"""checks/onesided.py: a relative-position bias that tells only the earlier distances apart (unidirectional T5
buckets) on a mask that lets each query see later keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from checkbugs import check_bug, first, traced
from maskcli.checks.onesided import _sides
from maskcli.trace.posbias import profile

ONESIDED = Path(__file__).parent / "data" / "onesided"


def test_audiolm_attention_without_a_causal_mask(tmp_path):
    """lucidrains/audiolm-pytorch 9cd86d2 (written blind, batch blind-dl): Attention.forward adds the causal T5 bucket
    bias (n = max(-(k - q), 0)) and goes to softmax with no causal mask. The first cell, by a double loop (20 tokens,
    no padding)."""
    [hit] = check_bug(tmp_path, "audiolm_pytorch_attention_missing_causal_mask", "position-bias-one-sided")
    assert tuple(hit["cell"]) == first((2, 20, 20), lambda b, q, k: k > q), hit


def test_t5_style_decoder_with_the_encoders_padding_mask(tmp_path):
    """Written another way: a T5-style decoder (bidirectional=False buckets, the mask added to the bias, HF's
    scores += position_bias) handed an extended mask of the right padding alone; rows of 7 and 4 tokens. The first
    real query that sees a later real key, by a double loop over the lengths."""
    [hit] = check_bug(tmp_path, "t5_style_decoder_unidirectional_buckets_padding_mask_only", "position-bias-one-sided",
                      ONESIDED)
    lengths = (7, 4)
    assert tuple(hit["cell"]) == first((2, 7, 7), lambda b, q, k: q < k < lengths[b]), hit


def _buckets(relative: np.ndarray, bidirectional: bool, buckets: int = 32, distance: int = 128) -> np.ndarray:
    """T5's relative_position_bucket, in numpy (the reference)."""
    found = np.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        found += (relative > 0) * buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    exact = buckets // 2
    with np.errstate(divide="ignore"):
        large = exact + (np.log(np.maximum(relative, 1) / exact) / np.log(distance / exact) * (buckets - exact)).astype(int)
    return found + np.where(relative < exact, relative, np.minimum(large, buckets - 1))


@pytest.mark.parametrize("bias, side", [
    ("unidirectional", 1), ("mirrored", -1), ("bidirectional", 0), ("alibi", 0), ("clamped alibi", 1)])
def test_which_side_a_bias_tells_apart(bias, side):
    """The profile trace/posbias.py reads of a bias over a full mask (12 tokens, 4 heads), read as flat on one side."""
    n, heads = 12, 4
    relative = np.arange(n)[None, :] - np.arange(n)[:, None]
    table = np.random.default_rng(0).normal(size=(32, heads))
    slopes = 2.0 ** -np.arange(1, heads + 1)
    made = {"unidirectional": lambda: table[_buckets(relative, False)],
            "mirrored": lambda: table[_buckets(-relative, False)],
            "bidirectional": lambda: table[_buckets(relative, True)],
            "alibi": lambda: slopes * relative[..., None],
            "clamped alibi": lambda: slopes * np.minimum(relative, 0)[..., None]}[bias]  # (TransformerLens's)
    values = torch.tensor(made(), dtype=torch.float32).permute(2, 0, 1)[None].expand(2, -1, -1, -1)
    found = profile((values,), torch.zeros(2, heads, n, n), torch.ones(2, heads, n, n, dtype=torch.bool))
    assert _sides(found) == side


def test_quiet_where_a_prefix_lm_sees_later_keys(monkeypatch):
    """The one-sided bias over a prefix LM's mask (T5X's decoder-only prefix LM: the first rows see the whole prefix,
    the last see no later key) is read flat on the later side, and quiet: some real query keeps to its past. Over a
    full mask, the first cell is a double loop's."""
    n, heads = 10, 2
    relative = np.arange(n)[None, :] - np.arange(n)[:, None]
    table = np.random.default_rng(1).normal(size=(32, heads))
    values = torch.tensor(table[_buckets(relative, False)], dtype=torch.float32).permute(2, 0, 1)[None]
    prefix = torch.tensor((relative <= 0) | (np.arange(n)[None, :] < 4))[None, None].expand(1, heads, n, n)
    found = profile((values,), torch.zeros(1, heads, n, n), prefix)
    assert _sides(found) == 1  # (the prefix's rows show the later side flat)

    class Call:  # (what _crossed reads of a trace call)
        shape = (1, heads, n, n)
        stored = {}

    from maskcli.checks import onesided

    monkeypatch.setattr(onesided, "keep", lambda call: prefix.numpy())
    assert onesided._crossed(Call(), 1) is None
    monkeypatch.setattr(onesided, "keep", lambda call: np.ones((1, heads, n, n), dtype=bool))
    assert onesided._crossed(Call(), 1) == first((1, n, n), lambda b, q, k: k > q)


def test_x_transformers_t5_buckets_causal_test_inverted(tmp_path):
    """lucidrains/x-transformers#10, fixed by 6d0c641 (written blind, blind-ta, caught before any rule changed for it):
    the T5 bucket function tested `if causal:` for `if not causal:`, so the copy task's encoder (no causal mask, a
    right-padded source) got one bucket for every later key. The first cell by a double loop over the encoder's
    mask: row 0 is unpadded (length 12), so query 0 sees key 1 first. Its fix keeps one true wrong finding of the
    program as written: the decoder's padded target rows see no key (a finite fill: uniform over the later pads) and
    the loss counts their pad targets (ignore_index -100, pad 0)."""
    lengths = [12, 8, 5]
    status, found, report = traced(tmp_path, "x_transformers_t5_rel_pos_bucket_causal_flag_inverted", False)
    [hit] = [f for f in found if f["code"] == "position-bias-one-sided"]
    assert tuple(hit["cell"]) == first((3, 12, 12), lambda b, q, k: k > q and k < lengths[b] and q < lengths[b])
    assert "or the bias was built one-sided for a layer meant to attend both ways" in " ".join(hit["message"].split())
    status, fixed, report = traced(tmp_path, "x_transformers_t5_rel_pos_bucket_causal_flag_inverted", True)
    assert {f["code"] for f in fixed if f["severity"] == "wrong"} == {"empty-rows-trained"}, report
    [empty] = [f for f in fixed if f["code"] == "empty-rows-trained"]
    b = 1  # (the first padded row: target length 1 + 8, input rows 9.. are pads)
    assert tuple(empty["cell"][:2]) == (b, lengths[b] + 1), empty
