"""Real frames hidden: an encoder whose convolutions subsample its padded input, and a key padding over the frames that
hides frames the convolutions computed from a row's real samples.

A speech encoder's strided convolutions turn S samples into L frames; the program holds its batch's padding over the S
samples (the lengths `x_len`, a `padding_mask`) and reduces it to the frames itself. The model's own stack says how many
frames each row's n real samples make (each layer maps n to (n + 2p - d(k - 1) - 1) // s + 1, as PyTorch sizes its
output: checks/subsampled.py's count): those are the frames the row makes alone, every one read from its real samples.
Where the key padding handed to the attention hides one of them from the row's queries, the reduction counted the frames
another way and the row loses a real frame as a key (S3Tokenizer#24/#25: the sample mask subsampled
`mask[:, :, (T + 1) % 2::2]`, its offset set by the batch's padded length T, not by the convolution: with T even an
odd-length row keeps the odd samples and loses its last frame; the fix counts the lengths by the conv formula).

The reverse of checks/subsampled.py (frames of the padding kept) under the same guards: read only where the stack's
layers, in the order the model registers them, map the held padding's S exactly to the call's L keys, the call is a
self-attention whose every query of a row sees the same keys (key padding), and the held padding is a padded batch
(one run of real samples from the start of each row), its rows the call's or folded with other rows (every way round
the fold is read must hide a made frame). Stays quiet where the row's frames are all seen (a mask that keeps too many
is subsampled.py's), where a layer's padding is not a number, and on a padding over the frames themselves (its S is L).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.frames import _key_padding
from maskcli.checks.registry import Rule
from maskcli.checks.subsampled import _folds, _inputs, _out_all, _real_counts, _stack, over_frames
from maskcli.text import Finding, spans


def made_frames_hidden(run: Run) -> list:
    """Self-attention calls over frames whose key padding hides frames the model's own convolutions computed from the
    real samples the program holds over a row."""
    return over_frames(run, run.calls, _finding)


def _finding(call, convs: tuple, helds: list, rows: int, k_len: int) -> Finding | None:
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    seen = _key_padding(np.broadcast_to(cells.any(axis=1), (rows, k_len, k_len)))
    if seen is None or seen.all():
        return None
    for held in helds:
        size = held["rows"].shape[0] if held["rows"].ndim else 0
        if size < 2 or rows % size:
            continue
        counted = _real_counts(held, size)
        if counted is None or counted[0] <= k_len:
            continue
        samples, real = counted
        layers = _stack(convs, samples, k_len)
        if layers is None:
            continue
        made, bads = _out_all(real, layers), []
        for each in _folds(size, rows):  # (a batch folded with its heads: every way round must hide a made frame)
            bads.append((each, ~seen & (np.arange(k_len)[None, :] < made[each][:, None])))
        if not all(bad.any() for _, bad in bads):
            continue
        each, bad = min(bads, key=lambda read: int(read[1].sum()))  # (the reading that hides the fewest: the fold's own)
        r = int(np.argwhere(bad.any(axis=1))[0][0])
        b, keys = int(each[r]), [int(k) for k in np.flatnonzero(bad[r])]
        n = int(real[b])
        said = f"{held['name']} in {held['where']}"
        fold = "" if rows == size else f" (call row {r}: the batch of {size} folded with {rows // size} rows each)"
        stack = ", ".join(f"k{k}/s{s}" + (f"/p{p}" if p else "") for k, s, p, _, _ in layers)
        first, last = _inputs(keys[0], layers)
        return Finding("made-frames-hidden", (
            f"batch row {b}{fold} has {n} real samples of {samples} ({said}); the model's own strided layers ({stack}) "
            f"make {int(made[b])} frames of them, yet this attention over the {k_len} frames hides "
            f"{'frame' if len(keys) == 1 else 'frames'} {spans(keys)} of that row from every query: frame {keys[0]} is computed from samples "
            f"{max(first, 0)}-{last}, and the row's real ones end at {n - 1} (the frame mask reduced from the sample "
            f"mask another way than the convolutions count: the row loses a real frame as a key, which it keeps alone)"),
            expected=f"batch row {b}: frames 0-{int(made[b]) - 1} real", source=said, cell=(r, 0, keys[0]))
    return None


RULES = (
    Rule("made-frames-hidden", "wrong", "call", "a key padding over an encoder's frames that hides frames its own "
         "strided convolutions computed from a row's real samples, as the program holds them (S3Tokenizer#24: the "
         "frame mask subsampled at an offset set by the batch's padded length)", made_frames_hidden),
)
