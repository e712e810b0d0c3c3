"""checks/padend.py (and trace/padend.py): a padding mask at the wrong end of the zeros its own input pads with, on the
published bug's reproduction (tests/data/bugs) and a program written another way (tests/data/padend), both quiet
fixed; the cells and the samples read against loops over each row's lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.padend import mirrored

PADEND = Path(__file__).parent / "data" / "padend"


def test_moment_research_forward_padding_masks_the_start(tmp_path):
    """moment-timeseries-foundation-model/moment-research#3 (commit d86ec3f; written blind, batch blind-et):
    upsample_timeseries(direction="forward") right-pads each series with zeros to 32 samples and zeroes
    `input_mask[:32 - len]`, the start: the T5 encoder, over patches of 4, masks real patches and attends the zero
    tail. Series of 20, 12 and 28 samples; row 0's hidden samples and zeros by their lengths."""
    length, samples = 20, 32
    hidden, zeros = f"0-{samples - length - 1}", f"{length}-{samples - 1}"
    hits = check_bug(tmp_path, "moment_research_upsample_forward_pad_input_mask_wrong_end", "padding-mask-wrong-end")
    assert hits and all(f"calls samples {hidden} padding" in hit["message"] and f"(samples {zeros})" in hit["message"]
                        and "`x` of <module>()" in hit["message"] for hit in hits), hits


def test_left_padded_windows_whose_key_padding_mask_counts_from_the_start(tmp_path):
    """Written another way: windows of 10, 6 and 3 steps left-padded with zeros ((B, S, C), F.pad), their
    `padding_mask` (True = padding) built `arange(S) >= length`; nn.TransformerEncoder, one key a step. The cells: each
    real query of a row (its last n steps) and each zero key (its first S - n) the mask keeps (its first n)."""
    samples, lengths = 10, (10, 6, 3)
    cells = sum(1 for n in lengths for q in range(samples - n, samples) for k in range(samples - n) if k < n)
    hits = check_bug(tmp_path, "left_padded_sensor_windows_mask_counts_from_start", "padding-mask-wrong-end", PADEND)
    assert hits and all(f"({cells} such cells)" in hit["message"] and "calls samples 6-9 padding" in hit["message"]
                        for hit in hits), hits


def _by_loop(real: np.ndarray, zero: np.ndarray) -> np.ndarray | None:
    """The padding the zeros state, by a loop over each padded row's edges; None where a row reads otherwise."""
    kept = [[s for s in range(real.shape[1]) if real[b, s]] for b in range(real.shape[0])]
    if all(zero[b, s] for b in range(real.shape[0]) for s in kept[b]) \
            and any(len(kept[b]) > real.shape[1] - len(kept[b]) for b in range(real.shape[0])):
        return None  # (no data where the mask keeps: a tensor times the padding flag, not padded samples)
    padding = np.zeros_like(real)
    for b in range(real.shape[0]):
        n = int(sum(1 for s in range(real.shape[1]) if not real[b, s]))
        if n == 0:
            continue
        start = all(not real[b, s] for s in range(n))
        end = all(not real[b, s] for s in range(real.shape[1] - n, real.shape[1]))
        other = range(real.shape[1] - n, real.shape[1]) if start else range(n) if end else None
        hidden = range(n) if start else range(real.shape[1] - n, real.shape[1])
        if other is None or all(zero[b, s] for s in hidden) or not all(zero[b, s] for s in other):
            return None
        for s in other:
            padding[b, s] = True
    return padding if padding.any() else None


def test_the_padding_read_against_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, samples = 3, 8
        lengths = rng.integers(1, samples + 1, rows)
        zeros_right = rng.random() < 0.5
        at = np.arange(samples)[None, :]
        data = at < lengths[:, None] if zeros_right else at >= samples - lengths[:, None]
        zero = ~data | (rng.random((rows, samples)) < 0.1)  # (the data holds a 0 now and then)
        kind = rng.integers(0, 3)  # (the mask at the wrong end, at the right one, or hiding other samples)
        real = data[:, ::-1] if kind == 0 else data if kind == 1 else rng.random((rows, samples)) < 0.7
        got, expected = mirrored(real, zero), _by_loop(real, zero)
        assert (got is None) == (expected is None) and (got is None or (got == expected).all())


def test_quiet_where_the_mask_hides_the_zeros_or_the_other_end_is_data():
    zero = np.array([[False] * 5 + [True] * 3])
    assert mirrored(np.array([[True] * 5 + [False] * 3]), zero) is None  # (the mask hides the zeros: right)
    assert mirrored(np.array([[False] * 4 + [True] * 4]), zero) is None  # (4 hidden, 3 zeros: another mask)
    assert mirrored(np.array([[False] * 3 + [True] * 5]), zero)[0].tolist() == [False] * 5 + [True] * 3


def test_quiet_where_the_input_is_zero_on_every_sample_the_mask_keeps():
    """speechbrain#2276: FastSpeech2's sinusoids times `srcmask` (True on padding): 0 at every real position, the
    sinusoids at the padded ones. Its zeros are the mask's complement multiplied in, not padding at the other end."""
    real = np.array([[True] * 8, [True] * 5 + [False] * 3])
    assert mirrored(real, real.copy()) is None
    # (MOMENT's bug, every row padded by half, still reads: the zeros are the n samples at the other end)
    half = np.array([[False] * 4 + [True] * 4])
    assert mirrored(half, half.copy())[0].tolist() == [False] * 4 + [True] * 4


def test_a_label_padded_with_nan_is_no_input_padded_with_zeros():
    # multicenter-sepsis' hourly labels: 0/1 with NaN past each stay's end, held beside the padding mask; their zeros
    # are negative hours, not samples the padding put there (a tensor of 0 and one other value, NaN aside, is a mask's
    # or a label's). Real samples with a zero run at one end are read.
    import torch

    from maskcli.trace.padend import _zeros

    nan = float("nan")
    labels = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, nan, nan]])
    assert _zeros(labels, (2, 5)) is None
    series = torch.tensor([[0.3, -1.2, 0.7, 2.0, 0.1], [0.0, 0.0, 0.5, 1.5, -0.4]])
    assert _zeros(series, (2, 5)).tolist() == [[False] * 5, [True, True, False, False, False]]
