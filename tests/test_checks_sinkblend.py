"""checks/sinkblend.py and trace/sinkblend.py: a stated attention sink blended with keys its window still holds (an
EMA sink that merged the newest frames, not the evicted ones); against the programs' own decay (w = 1 - alpha) and a
blend made here with torch's rotation."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from checkbugs import check_bug
from maskcli.trace.sinkblend import sink_blend

SINKBLEND = Path(__file__).parent / "data" / "sinkblend"


def _blend(message: str) -> tuple[float, int, int]:
    found = re.search(r"w = ([0-9.e-]+), with keys (\d+) \.\. (\d+)", message)
    return float(found.group(1)), int(found.group(2)), int(found.group(3))


def test_reward_forcing_ema_sink_merges_the_newest_frames(tmp_path):
    """JaydenLyh/Reward-Forcing#5 (commit 4317f5a; written blind, batch blind-en): CausalWanSelfAttention's rolling
    cache sliced the frames it evicts into the EMA sink from `sink + rolled` (the newest block, still in the window)
    instead of from `sink` (the oldest block, which leaves); 3 sink frames of 4 tokens, blocks of 3 frames."""
    [hit, *_] = check_bug(tmp_path, "reward_forcing_causal_wan_ema_sink_evicts_newest_frames", "sink-blends-kept-keys")
    w, lo, hi = _blend(hit["message"])
    assert abs(w - (1 - 0.999)) < 1e-6 and (lo, hi) == (12, 23)  # (the block after the sink, rolled to the front)


def test_frame_cache_ema_sink_merges_latest_frame_written_another_way(tmp_path):
    """The same bug in a frame-by-frame rollout over a list of per-frame K/V, a config dataclass, rotate_half RoPE
    over 1-D positions and a batch of two: the frame just appended merged into the sink instead of the one popped."""
    [hit, *_] = check_bug(tmp_path, "frame_cache_ema_sink_merges_latest_frame", "sink-blends-kept-keys", SINKBLEND)
    w, lo, hi = _blend(hit["message"])
    assert abs(w - (1 - 0.95)) < 1e-6 and (lo, hi) == (9, 11)  # (the newest frame: the last 3 of 12 keys)


def _rotated(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    angles = positions[:, None].double() * (1.0 / 10000 ** (torch.arange(half).double() / half))[None]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def test_a_blend_with_a_key_of_the_call_is_found_and_one_with_a_key_gone_is_not():
    """Sink rows 0-1 blended (0.9 / 0.1) with raw keys that sit, rotated, at rows 4-5 of the same call are found with
    w = 0.1 and those rows; blended with keys no row of the call holds, nothing is found."""
    torch.manual_seed(0)
    raw = torch.randn(8, 16, dtype=torch.float64)  # rows 0-1 the sink, 2-7 frames; 6-7 a frame that leaves later
    positions = torch.arange(6)
    before = _rotated(torch.cat((raw[:2], raw[2:6])), positions)[None, None]
    kept = torch.cat((0.9 * raw[:2] + 0.1 * raw[4:6], raw[2:6]))
    found = sink_blend(before, _rotated(kept, positions)[None, None], (1, 1, 6, 16))["sink_blend"]
    assert found["rows"] == [0, 1] and found["from"] == [4, 5] and abs(found["w"] - 0.1) < 1e-9
    gone = torch.cat((0.9 * raw[:2] + 0.1 * raw[6:8], raw[2:6]))
    assert sink_blend(before, _rotated(gone, positions)[None, None], (1, 1, 6, 16)) == {}
