"""checks/heldsinks.py: a module that holds learned per-head sinks whose SDPA or MHA mask has no term for them, caught
in the published bug's reproduction (tests/data/bugs: vLLM's MiMo windowed vision blocks) and in a program written
another way (tests/data/heldsinks: nn.MultiheadAttention, a right-padded batch, a dataclass config), quiet on their
fixes and on a correct program that hands SDPA the sink as an extra key. The cell is checked against a double loop
over the program's own band, and the dropped sinks against SDPA run with and without them."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from checkbugs import check_bug, first, traced

HELDSINKS = Path(__file__).parent / "data" / "heldsinks"


def _values(message: str) -> list[float]:
    return [float(v) for v in re.search(r"heads: ([-\d., ]+)\)", message).group(1).split(", ")]


def test_mimo_window_attention_dropping_its_sinks_is_found(tmp_path):
    """vllm-project/vllm#49815 (written blind): blocks 1 and 2 hold `attn.sinks` = [2, -1, 3, 0.5] and their window
    path hands SDPA a band mask (|q - k| <= 3 within each image) with no sink; block 0 holds none and is not named."""
    found = check_bug(tmp_path, "vllm_mimo_vision_window_attn_drops_sinks", "sinks-dropped")
    assert all(f["severity"] == "wrong" for f in found)
    assert all(f["message"].startswith("the MiMoVisionAttention module that made these calls") for f in found)
    assert all(_values(f["message"]) == [2.0, -1.0, 3.0, 0.5] for f in found)
    assert all("4 heads" in f["message"] and "adds nothing but 0 and its fill" in f["message"] for f in found)
    for f in found:  # the first kept cell of batch row 0 by a double loop over the band the program states (w = 3)
        n = 16  # (both images' calls start alike: query 0 keeps key 0)
        assert tuple(f["cell"]) == first((1, n, n), lambda b, q, k: abs(q - k) <= 3)


def test_the_dropped_sinks_change_what_sdpa_computes():
    """The reference the rule stands on: sinks[h] on key 0 changes each head's output (SDPA with and without it), so a
    mask with no term for them computes something else."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    band = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs() > 3
    bias = torch.zeros(1, 4, 6, 6).masked_fill(band, float("-inf"))
    with_sinks = bias.clone()
    with_sinks[..., 0] += torch.tensor([2.0, -1.0, 3.0, 0.5]).view(1, 4, 1)
    without = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert not torch.allclose(without, F.scaled_dot_product_attention(q, k, v, attn_mask=with_sinks), atol=1e-3)


def test_mha_window_encoder_dropping_its_sinks_is_found(tmp_path):
    """The same bug written another way: nn.MultiheadAttention, a bool block band mask and a key_padding_mask over
    images of 7 and 5 patches; the fix hands MHA a (B * H, L, L) float mask with sinks[h] on each image's key 0."""
    found = check_bug(tmp_path, "mha_window_encoder_sinks_dropped_right_padded", "sinks-dropped", folder=HELDSINKS)
    assert len(found) == 1  # (both blocks' calls hand one mask: one finding)
    f = found[0]
    assert f["severity"] == "wrong" and "SinkWindowBlock" in f["message"] and "its mha call" in f["message"]
    assert _values(f["message"]) == [1.5, -0.5, 2.5]
    lengths, window = [7, 5], 2
    assert tuple(f["cell"]) == first((1, 7, 7), lambda b, q, k: abs(q - k) <= window and k < lengths[b])


def test_sdpa_handed_the_sink_as_an_extra_key_column_is_quiet(tmp_path):
    """Correct: a GPT-OSS-style layer prepends a zero key and value and puts sinks[h] in that column of a finfo.min
    mask (a left-padded batch, GQA, one decode step): the mask differs between heads, the sink is in it."""
    status, found, report = traced(tmp_path, "quiet_gptoss_sdpa_sink_key_column_left_padded", False, HELDSINKS)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert not [f for f in found if f["code"] == "sinks-dropped"]
