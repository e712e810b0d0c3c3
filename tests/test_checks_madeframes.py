"""checks/madeframes.py: a frame key padding that hides frames the model's own strided convolutions computed from a
row's real samples, the frames each row makes counted here by running the convolutions themselves on the row alone."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, first, traced

MADEFRAMES = Path(__file__).parent / "data" / "madeframes"


def made(n: int, layers) -> int:
    """How many frames `n` samples make through `layers`, by running them on a tensor of n samples (the row alone)."""
    x = torch.zeros(1, 1, n)
    for layer in layers:
        x = layer(x)
    return x.shape[-1]


def conv1d(k: int, s: int, p: int = 0) -> torch.nn.Conv1d:
    return torch.nn.Conv1d(1, 1, k, stride=s, padding=p)


def subsampled_by_parity(n: int, padded: int, halvings: int) -> int:
    """The frames the buggy reduction keeps of a row of n real samples padded to `padded`: the sample mask sliced
    `[(T + 1) % 2::2]` once per halving, T its current length (S3Tokenizer before #24/#25)."""
    keep = [t < n for t in range(padded)]
    for _ in range(halvings):
        keep = keep[(len(keep) + 1) % 2::2]
    return sum(keep)


def test_s3tokenizer_frame_mask_subsampled_at_the_batch_parity(tmp_path):
    """xingchensong/S3Tokenizer#24/#25 (written blind, batch blind-fe): mel lengths 96 and 71; conv1 (k3/s1/p1) and
    conv2 (k3/s2/p1) make 36 frames of row 1's 71 real samples, the mask sliced from offset (96 + 1) % 2 = 1 keeps 35:
    frame 35, made of real samples 69-70, is hidden from every query of that row."""
    [hit] = check_bug(tmp_path, "s3tokenizer_audio_encoder_frame_mask_subsampled_by_batch_parity", "made-frames-hidden")
    lengths, layers = (96, 71), [conv1d(3, 1, 1), conv1d(3, 2, 1)]
    frames = [made(n, layers) for n in lengths]
    kept = [subsampled_by_parity(n, 96, 1) for n in lengths]
    cell = first((2, 48, 48), lambda b, q, k: q < kept[b] and kept[b] <= k < frames[b])
    assert cell is not None and hit["cell"] == [cell[0], 0, cell[2]], hit
    assert f"make {frames[1]} frames of them" in hit["message"] and "loses a real frame as a key" in hit["message"]


def test_s3tokenizer_v2_frame_mask_sliced_twice_by_the_padded_width(tmp_path):
    """xingchensong/S3Tokenizer#26 (written blind, blind-hv, round 54; caught before tuning): AudioEncoderV2 slices
    its mel-rate mask every other column twice, from an offset set by the padded width's parity, for two stride-2
    convolutions; row 1's 30 real samples make 8 frames, the twice-sliced mask keeps fewer."""
    [hit] = check_bug(tmp_path, "s3tokenizer_v2_25hz_encoder_mask_sliced_by_padded_width_parity", "made-frames-hidden")
    assert "batch row 1 has 30 real samples of 40" in hit["message"] and "make 8 frames of them" in hit["message"]


def test_conformer_frame_lengths_floored_by_the_subsampling_factor(tmp_path):
    """Written another way: NeMo/icefall-style `feat_lens // 4` under two Conv1d(k3/s2/p1) (ceil(n / 2) frames each),
    the config a dict, features batch-first, three rows, nn.MultiheadAttention's key_padding_mask: rows of 50 and 37
    real samples lose their last real frame."""
    name = "conformer_frame_lengths_floored_by_subsampling_factor"
    [hit] = check_bug(tmp_path, name, "made-frames-hidden", MADEFRAMES)
    lengths, layers = (50, 64, 37), [conv1d(3, 2, 1), conv1d(3, 2, 1)]
    frames = [made(n, layers) for n in lengths]
    cell = first((3, 16, 16), lambda b, q, k: lengths[b] // 4 <= k < frames[b])
    assert hit["cell"] == [cell[0], 0, cell[2]] and f"hides frame {cell[2]} of that row" in hit["message"], hit


def test_patch_frames_floored_by_the_stride_are_the_convs_own_count(tmp_path):
    """Correct: a Conv1d(k4/s4) patch embedding makes exactly n // 4 frames of n samples (a trailing partial patch is
    never computed), so the frame mask floored by the stride hides no frame it made: quiet."""
    name = "patch_conv_frame_mask_floored_by_stride_correct"
    assert all(made(n, [conv1d(4, 4)]) == n // 4 for n in (64, 47, 30))
    status, found, report = traced(tmp_path, name, False, MADEFRAMES)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
