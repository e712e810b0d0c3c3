"""checks/swinroll.py (and trace/swinroll.py): a shifted-window block that rolls its map by another shift than its
own shift_size, on the published bug's reproduction (tests/data/bugs) and a block written another way
(tests/data/swin), both quiet fixed; the roll read against a loop over the map's cells."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced
from maskcli.checks.swinroll import _off
from maskcli.trace.swinroll import _offset

SWIN = Path(__file__).parent / "data" / "swin"


def test_fengwu_longitude_rolled_by_the_latitude_shift_is_found(tmp_path):
    """NVIDIA/physicsnemo#1492 (written blind, batch blind-bk): shift_size=(1, 3), the map rolled by (-1, -1) along
    (lat, lon); the mask built for shift_lon = 3."""
    [hit] = check_bug(tmp_path, "physicsnemo_fengwu_window_shift_rolls_lon_by_lat", "swin-roll-shift")
    assert "states shift_size=(1, 3) (window_size=(2, 6)) but rolls its 4x12 map by (-1, -1)" in hit["message"]
    assert "axis 2 (length 12) by 1, not 3" in hit["message"] and "axis 1" not in hit["message"].split(":")[1]


def test_a_channel_first_block_rolled_by_half_the_window_is_found(tmp_path):
    """Written another way: (B, C, H, W) maps rolled along dims (2, 3) by window_size // 2 = 2 under shift_size=1,
    an additive -inf mask over an einsum softmax in the block itself."""
    [hit] = check_bug(tmp_path, "channel_first_block_rolls_half_window", "swin-roll-shift", SWIN)
    assert "rolls its 8x8 map by (-2, -2) along axes (2, 3)" in hit["message"]


def test_pangu_longitude_rolled_by_the_latitude_shift_is_found(tmp_path):
    """lizhuoq/WeatherLearn#4, commit dc896e6 (written blind, batch blind-ek): Pangu's 3-D EarthSpecificBlock states
    shift_size=(1, 3, 6) and rolls its (Pl, Lat, Lon) map by (-1, -3, -3): longitude by shift_lat."""
    [hit] = check_bug(tmp_path, "weatherlearn_pangu_earth_specific_block_roll_lon_by_lat_shift", "swin-roll-shift")
    assert "shift_size=(1, 3, 6) (window_size=(2, 6, 12)) but rolls its 2x6x24 map by (-1, -3, -3)" in hit["message"]
    assert "axis 3 (length 24) by 3, not 6" in hit["message"] and "axis 2 (" not in hit["message"]


def test_a_video_block_rolled_by_half_its_3d_window_is_found(tmp_path):
    """Written another way: channel-first clips (B, C, T, H, W), windows (2, 4, 4), shift_size (1, 1, 1), rolled by
    half the window (-1, -2, -2) along dims (2, 3, 4): H and W off, T as stated."""
    [hit] = check_bug(tmp_path, "video_block_rolls_half_window_3d", "swin-roll-shift", SWIN)
    assert "rolls its 4x8x8 map by (-1, -2, -2) along axes (2, 3, 4)" in hit["message"], hit["message"]
    assert "axis 3 (length 8) by 2, not 1, axis 4 (length 8) by 2, not 1" in hit["message"]
    assert "axis 2 (" not in hit["message"]


def test_swins_own_block_and_the_earlier_swin_program_roll_as_stated(tmp_path):
    """microsoft/Swin-Transformer's construction (roll by -shift_size) and the half-window-mask program (its bug is
    the mask, its roll is right): no swin-roll-shift."""
    quiet = Path(__file__).parent / "data" / "quiet_blind"
    for name, folder in (("swin_shifted_window_attention", quiet), ("swin_mask_built_for_half_window_shift", SWIN)):
        for fixed in (False, True):
            _, found, report = traced(tmp_path, name, fixed, folder)
            assert "swin-roll-shift" not in [f["code"] for f in found], report


def _loop_roll(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """x rolled by (a, b) along dims (1, 2) by a loop over the cells: out[i, j] = x[i - a, j - b]."""
    out = torch.empty_like(x)
    h, w = x.shape[1], x.shape[2]
    for i in range(h):
        for j in range(w):
            out[:, i, j] = x[:, (i - a) % h, (j - b) % w]
    return out


def test_the_offset_found_is_the_loops():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 12, 3)
    for a, b in ((-1, -3), (-1, -1), (2, 5), (0, 6)):
        assert _offset(x, _loop_roll(x, a, b), (1, 2)) == (a % 4, b % 12)
    assert _offset(x, x.clone(), (1, 2)) is None  # (no roll)
    assert _offset(torch.zeros(1, 4, 4, 2), torch.zeros(1, 4, 4, 2), (1, 2)) is None  # (every offset: none said)
    assert not _off(11, 1, 12) and not _off(1, 1, 12) and _off(11, 3, 12)


def _loop_roll_3d(x: torch.Tensor, offset: tuple) -> torch.Tensor:
    """x rolled by `offset` along dims (2, 3, 4) by a loop over the cells: out[i, j, k] = x[i - a, j - b, k - c]."""
    out = torch.empty_like(x)
    t, h, w = x.shape[2:]
    for i in range(t):
        for j in range(h):
            for k in range(w):
                out[:, :, i, j, k] = x[:, :, (i - offset[0]) % t, (j - offset[1]) % h, (k - offset[2]) % w]
    return out


def test_the_3d_offset_found_is_the_loops():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 2, 6, 8)
    for offset in ((-1, -3, -3), (1, 0, 2), (0, -1, 0)):
        assert _offset(x, _loop_roll_3d(x, offset), (2, 3, 4)) == tuple(o % n for o, n in zip(offset, (2, 6, 8)))
    assert _offset(x, x.clone(), (2, 3, 4)) is None
