"""checks/patches.py: a vision tower's real patches attending patches its images hold as exactly-0 padding that
the patch mask calls real (the zero patches found here by a loop over each patch's pixels); a tower handed a patch
mask run causal over its patches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug, first, traced

PATCHES = Path(__file__).parent / "data" / "patches"


def zero_patches(images: np.ndarray, side: int) -> list[list[int]]:
    """Each image's patches (row by row) whose pixels are all 0, by a plain loop."""
    found = []
    for image in images:
        _, height, width = image.shape
        index, row = 0, []
        for top in range(0, height, side):
            for left in range(0, width, side):
                if all(image[c, y, x] == 0 for c in range(image.shape[0]) for y in range(top, top + side)
                       for x in range(left, left + side)):
                    row.append(index)
                index += 1
        found.append(row)
    return found


def test_minicpmv_patch_mask_filled_along_its_size_one_axis(tmp_path):
    """MiniCPM-V#274: slices of 2x3 and 1x4 patches padded to 6; the (B, 1, 6) mask filled as [i, :n] is all True."""
    pytest.importorskip("transformers")
    [hit] = check_bug(tmp_path, "minicpmv_patch_attn_mask_middle_dim_all_true", "padded-patches-attended")
    real, padded = 4, 6  # 1 x 4 patches of the second slice, padded to 2 x 3's 6
    assert hit["cell"] == [1, 0, real] and f"patches {real}-{padded - 1} of the `pixel_values`" in hit["message"]


def test_bottom_padded_images_with_a_mask_of_the_padded_size(tmp_path):
    """Written another way: a Conv2d patch embedding over a 4 x 4 grid, the shorter image padded at the bottom,
    nn.MultiheadAttention's key_padding_mask; the fix (each image's own rows) is quiet."""
    import torch

    torch.manual_seed(0)
    images = np.zeros((2, 3, 16, 16), dtype=np.float32)
    images[0], images[1, :, :12] = 1.0, 1.0  # the program's sizes: 16 and 12 pixel rows
    expected = zero_patches(images, 4)
    assert expected == [[], [12, 13, 14, 15]]
    status, found, report = traced(tmp_path, "vit_bottom_padded_images_mask_from_wrong_size", False, PATCHES)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "padded-patches-attended"]
    assert hit["severity"] == "wrong" and hit["cell"] == [1, 0, expected[1][0]], report
    status, found, report = traced(tmp_path, "vit_bottom_padded_images_mask_from_wrong_size", True, PATCHES)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_zero_patches_read_as_the_loop_reads_them():
    """trace's _zero_patches against the loop, on images with a zero patch inside (not padding: the rule's _padded
    needs a run at the row's end) and a zero tail."""
    import torch

    from maskcli.checks.patches import _padded
    from maskcli.trace.tops import _zero_patches

    rng = np.random.default_rng(0)
    images = rng.standard_normal((3, 3, 8, 12)).astype(np.float32)
    images[1, :, 4:, 8:] = 0  # the last patch
    images[2, :, :4, :4] = 0  # the first patch: not padding
    found = _zero_patches(torch.from_numpy(images), 6)
    loop = zero_patches(images, 4)
    assert [np.flatnonzero(row).tolist() for row in found] == loop
    assert not _padded(found) and _padded(found[:2])


def test_onnxruntime_siglip_fused_attention_marked_causal(tmp_path):
    """microsoft/onnxruntime#25360 (written blind, batch blind-ce; missed before tuning): the CLIP attention fusion sets
    `causal=(add_mask is not None)`, so SigLIP's tower, handed a patch_attention_mask, runs causal over its patches.
    The first cell is the first (row, patch, later patch) a double loop finds with both patches real."""
    [hit, *_] = check_bug(tmp_path, "onnxruntime_siglip_fused_attention_marked_causal", "patches-run-causal")
    real = [[True] * 9, [True] * 6 + [False] * 3]  # the program's patch_attention_mask
    assert tuple(hit["cell"]) == first((2, 9, 9), lambda b, q, k: real[b][q] and real[b][k] and k > q)


def test_a_navit_tower_written_by_hand_run_causal_over_its_patches(tmp_path):
    """The same bug written another way: a NaViT-style tower over images of 9 and 6 patches, a (B, 1, P) patch_attn_mask,
    a hand-written softmax whose export helper adds a triu(1) to every masked attention. Found, at the first cell a
    double loop finds; its fix (padding only) is quiet."""
    status, found, report = traced(tmp_path, "navit_tower_bool_mask_causal_flag", fixed=False, folder=PATCHES)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "patches-run-causal")
    real = [[True] * 9, [True] * 6 + [False] * 3]
    assert hit["severity"] == "wrong" and tuple(hit["cell"]) == first(
        (2, 9, 9), lambda b, q, k: real[b][q] and real[b][k] and k > q)
    status, found, report = traced(tmp_path, "navit_tower_bool_mask_causal_flag", fixed=True, folder=PATCHES)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
