"""checks/frames.py: an encoder over fewer frames than its input whose key padding hides frames of an unpadded
sample, against key padding written by a double loop here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import check_bug, traced
from maskcli import tracefile
from maskcli.checks.context import Run, Top
from maskcli.checks.frames import real_frames_masked

FRAMES = Path(__file__).parent / "data" / "frames"


def padded(lengths: list[int], length: int, queries: int, causal: bool = False) -> np.ndarray:
    """(B, 1, Lq, Lk) bool, cell by cell: each row's first `lengths[b]` keys real (and k <= q where causal)."""
    out = np.zeros((len(lengths), 1, queries, length), dtype=bool)
    for b, real in enumerate(lengths):
        for q in range(queries):
            for k in range(length):
                out[b, 0, q, k] = k < real and (not causal or k <= q)
    return out


def run_of(keep: np.ndarray, **arguments) -> Run:
    stored = tracefile.from_dense(keep, keep.shape)
    call = SimpleNamespace(index=0, where="encoder.layers.0.attn", api="sdpa", step=0, shape=keep.shape, details={},
                           stored=stored, mask="m")
    return Run([call], [Top("Model", arguments=arguments, first=0, end=1)])


def test_wav2vec2_frame_mask_counted_with_the_adapters_strides(tmp_path):
    """transformers#16725 (Flax Wav2Vec2): the encoder's frame mask divided by the adapter's strides too: 3 of the
    unpadded utterance's 19 frames kept."""
    [hit] = check_bug(tmp_path, "wav2vec2_reduced_mask_counts_adapter_downsampling", "real-frames-masked")
    assert hit["cell"] == [0, 0, 3] and "hides frames 3-18 from every query (16 of 19)" in hit["message"]


def test_a_conformer_subsampling_counted_twice_left_padded_through_mha(tmp_path):
    """Written another way: log-mel features left-padded, one stride-2 convolution, frame lengths divided by 4,
    nn.MultiheadAttention's key_padding_mask. The frames hidden in the unpadded row are those a double loop over the
    buggy lengths hides; the fix (the convolution's own output length) is quiet."""
    import torch

    frames = torch.nn.Conv1d(16, 1, kernel_size=3, stride=2, padding=1)(torch.zeros(1, 16, 20)).shape[-1]
    kept = 20 // 4  # the buggy length of the unpadded row
    hidden = [k for k in range(frames) if not k >= frames - kept]  # left padding: the first frames are the pads
    status, found, report = traced(tmp_path, "conformer_subsampling_lengths_counted_twice", False, FRAMES)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "real-frames-masked"]
    assert hit["severity"] == "wrong" and f"hides frames {hidden[0]}-{hidden[-1]} from every query" in hit["message"]
    status, found, report = traced(tmp_path, "conformer_subsampling_lengths_counted_twice", True, FRAMES)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_quiet_where_the_mask_is_not_the_inputs_padding_reduced():
    """Unpadded rows' frames all real: quiet. A causal mask (a decoder's), token ids handed (the mask is the text's),
    as many keys as samples, a batch whose mask is no padding: quiet, though the same row hides frames."""
    mask = np.ones((2, 40), dtype=np.int64)
    mask[1, 30:] = 0
    assert real_frames_masked(run_of(padded([10, 7], 10, 10), attention_mask=mask)) == []
    bad = padded([4, 3], 10, 10)
    [(_, found)] = real_frames_masked(run_of(bad, attention_mask=mask))
    assert found.code == "real-frames-masked" and found.cell == (0, 0, 4)
    assert real_frames_masked(run_of(padded([4, 3], 10, 10, causal=True), attention_mask=mask)) == []
    assert real_frames_masked(run_of(bad, attention_mask=mask, input_ids=np.ones((2, 40), np.int64))) == []
    assert real_frames_masked(run_of(padded([4, 3], 40, 40), attention_mask=mask)) == []
    middle = mask.copy()
    middle[0, 5] = 0  # a hole in a row: a loss or masked-LM mask, not padding
    assert real_frames_masked(run_of(bad, attention_mask=middle)) == []
