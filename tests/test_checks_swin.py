"""checks/swin.py (and trace/swin.py): a shifted-window mask that differs from the one its block's shift and window
sizes fix, against a loop over each window's tokens written here."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import BUGS, check_bug, traced
from maskcli.checks.swin import expected

SWIN = Path(__file__).parent / "data" / "swin"


def reference(height: int, width: int, window: int, cut: int) -> np.ndarray:
    """(nW, N, N) by a loop: tokens of one window attend where, on the rolled map, each coordinate lies in the same of
    the three bands [0, H - window), [H - window, H - cut), [H - cut, H)."""
    def band(x, size):
        return 0 if x < size - window else 1 if x < size - cut else 2

    out = []
    for top in range(0, height, window):
        for left in range(0, width, window):
            cells = [(top + i, left + j) for i in range(window) for j in range(window)]
            out.append([[band(a[0], height) == band(b[0], height) and band(a[1], width) == band(b[1], width)
                         for b in cells] for a in cells])
    return np.array(out, dtype=bool)


def test_the_mask_swin_builds_is_the_loops():
    for height, width, window, shift in ((8, 8, 4, 2), (12, 12, 6, 1), (8, 12, 4, 1)):
        assert np.array_equal(expected(height, width, window, shift), reference(height, width, window, shift))


def test_resshift_channel_first_regions_cut_along_one_axis(tmp_path):
    """zsyOAOA/ResShift#81: `img_mask[:, h, w, :]` on a (1, 1, H, W) map and a permute that transposes each window."""
    [hit] = check_bug(tmp_path, "resshift_swin_calculate_mask_channel_first_img_mask", "swin-mask-regions")
    assert "shift_size=2, window_size=4 over a 8x8 map" in hit["message"]


def test_a_mask_cut_at_half_the_window_under_a_shift_of_one(tmp_path):
    """Written another way: channel-last, a bool attn_mask repeated per image into SDPA, the regions cut at
    window_size // 2 = 3 while the block rolls by 1. The cells apart are the loop's, for both images."""
    differ = int((reference(12, 12, 6, 3) != reference(12, 12, 6, 1)).sum()) * 2
    status, found, report = traced(tmp_path, "swin_mask_built_for_half_window_shift", False, SWIN)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "swin-mask-regions"]
    assert f"differs in {differ} cells" in hit["message"] and hit["severity"] == "wrong"
    status, found, report = traced(tmp_path, "swin_mask_built_for_half_window_shift", True, SWIN)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_uformer_shifted_block_mask_with_no_region_labels(tmp_path):
    """ZhendongWang6/Uformer c715ca5 (written blind, batch blind-ek): LeWinTransformerBlock (its window named
    `win_size`) built its SW-MSA mask from an all-zero img_mask, so every pair of a shifted window is kept: it differs
    from the loop's mask wherever the loop hides a pair."""
    [hit] = check_bug(tmp_path, "uformer_lewin_block_shift_mask_without_region_labels", "swin-mask-regions")
    differ = int((~reference(16, 16, 8, 4)).sum())
    assert "shift_size=4, window_size=8 over a 16x16 map" in hit["message"], hit["message"]
    assert f"differs in {differ} cells" in hit["message"]


def test_a_padded_block_whose_region_labels_are_never_written(tmp_path):
    """Written another way: a 10x10 map padded to 12x12, windows of 6 shifted by 3, a bool SDPA mask repeated for 2
    images whose label map stayed all 0 (the loop rebinds a name): every pair the loop hides is kept."""
    [hit] = check_bug(tmp_path, "padded_block_region_labels_never_written", "swin-mask-regions", SWIN)
    differ = int((~reference(12, 12, 6, 3)).sum()) * 2
    assert "shift_size=3, window_size=6 over a 12x12 map" in hit["message"], hit["message"]
    assert f"differs in {differ} cells" in hit["message"]


def test_swins_own_block_is_quiet(tmp_path):
    """microsoft/Swin-Transformer's construction, two blocks (no shift, then shift 2): nothing found."""
    folder = Path(__file__).parent / "data" / "quiet_blind"
    status, found, report = traced(tmp_path, "swin_shifted_window_attention", False, folder)
    assert status == 0 and "swin-mask-regions" not in [f["code"] for f in found], report


def test_esvit_mask_from_the_init_resolution_on_a_smaller_crop(tmp_path):
    """microsoft/esvit commit b3c892f (issue microsoft/esvit#9): `create_attn_mask(self.H, self.W)` builds the mask of
    the 8x8 map the block was made for; the local crops' 4x4 maps (one window each, four images) get its four windows.
    The map is the one the block rolled; the cells apart are the loop's over that 4x4 map, against the 8x8 mask."""
    [hit] = check_bug(tmp_path, "esvit_swin_block_shift_mask_from_init_resolution", "swin-mask-regions")
    held = reference(8, 8, 4, 2)
    differ = int((held != np.tile(reference(4, 4, 4, 2), (4, 1, 1))).sum())
    assert "over a 4x4 map (the map the block rolled; its input_resolution is 8x8)" in hit["message"], hit
    assert f"differs in {differ} cells" in hit["message"], hit


def test_a_mask_registered_for_the_init_resolution_run_on_a_larger_map(tmp_path):
    """Written another way: a bool buffer registered in __init__ for 8x8 (4 windows), repeated over the windows of a
    16x16 map (16 per image) into SDPA: the mask holds 4 windows where the map rolled is cut into 16 (16 // 4 by the
    loop's count of windows); the fix, built per map size, is quiet."""
    [hit] = check_bug(tmp_path, "registered_mask_run_at_larger_resolution", "swin-mask-regions", SWIN)
    assert f"cut into {len(reference(16, 16, 4, 2))} windows per image" in hit["message"], hit
    assert f"has {len(reference(8, 8, 4, 2))} windows" in hit["message"], hit


def test_keras_hub_regions_cut_at_half_the_map_are_flagged_and_its_fix_rolled_then_padded_is_not(tmp_path):
    """keras-team/keras-hub#2298 (d7e3f89e1; written blind, blind-iz, round 60: caught before tuning, and its fix then
    a false alarm): the regions cut at H // 2 instead of H - window_size. The fix rolls the 6 x 6 map of its second
    stage and pads the labels to 8 x 8 with 0 as window_partition pads the tokens: read against the stated resolution."""
    check_bug(tmp_path, "keras_hub_swin_shifted_window_mask_regions_split_at_half_height", "swin-mask-regions")


def test_a_map_rolled_then_padded_to_whole_windows_against_a_loop():
    """expected(..., real=(H, W)): the regions cut on the real H x W map (rows and columns at H - window and H - shift),
    the padding to whole windows labelled 0; a loop over the windows' tokens compares their labels."""
    for height, width, window, shift in ((6, 6, 4, 2), (5, 7, 4, 2), (9, 6, 3, 1)):
        padded_h, padded_w = -(-height // window) * window, -(-width // window) * window
        label = {}
        for i in range(padded_h):
            for j in range(padded_w):
                if i >= height or j >= width:
                    label[i, j] = 0
                else:
                    row = 0 if i < height - window else 1 if i < height - shift else 2
                    column = 0 if j < width - window else 1 if j < width - shift else 2
                    label[i, j] = 3 * row + column
        tokens = [[(top + a, left + b) for a in range(window) for b in range(window)]
                  for top in range(0, padded_h, window) for left in range(0, padded_w, window)]
        loop = np.array([[[label[p] == label[q] for q in win] for p in win] for win in tokens])
        assert (expected(padded_h, padded_w, window, shift, real=(height, width)) == loop).all()


def test_timm_swin_v2_rolls_then_pads_with_a_mask_cut_on_the_padded_map(tmp_path):
    """huggingface/pytorch-image-models#2438 (written blind, blind-ks): SwinTransformerV2Block._attn rolls the 9 x 9 map
    and pads it to 12 x 12 after, with dynamic_mask=True labelling the regions on the padded map; the fix pads first.
    Written another way (tests/data/swin): a V1-style block over a 6 x 6 map padded to 8 x 8, scores reshaped per image.
    The mask read against the loop above: the padded map's regions, not the real map's."""
    for name, folder in (("timm_swin_v2_dynamic_mask_pad_after_cyclic_shift", BUGS),
                         ("block_rolls_then_pads_mask_on_padded_map", SWIN)):
        [hit, *_] = check_bug(tmp_path, name, "swin-mask-regions", folder)
        assert "before padding it to" in hit["message"] and "pad the map first" in hit["message"]
    real, padded = expected(8, 8, 4, 2, real=(6, 6)), expected(8, 8, 4, 2)
    assert (real != padded).any()
