"""Frames made of padding called real: an encoder whose convolutions subsample its padded input, and a key padding
over the frames that keeps frames the convolutions computed from the padding.

A speech encoder's strided convolutions (and poolings) turn S samples into L frames; the program holds its batch's
padding over the S samples (a `padding_mask`, the lengths `xs_lens`) and reduces it to the frames itself. The model's
own stack says how many frames each row's n real samples make: each layer maps n to (n + 2p - d(k - 1) - 1) // s + 1
(rounded up for a ceil_mode pooling), as PyTorch sizes its output, and frame t of a row is computed from padding from
that count on. Where the key padding handed to the attention keeps such a frame, the reduction counted the frames
another way (fairseq#3227: the sample mask cut to a multiple of L and `view(B, L, -1).all(-1)`; wenet#1602: the mask
subsampled `[:-2:2]`, the first sample of each receptive field, where the last one says whether it is real).

Read only where the stack's layers, in the order the model registers them, map the held padding's S exactly to the
call's L keys (the layers up to there: a positional convolution or an adapter after them is not counted), the call is
a self-attention (where its queries of a row see different keys, a chunked or causal streaming mask, the keys a row's
real frames see: sglang-omni#1879's MiniCPM-o audio encoder, its chunk mask and'd with lengths still counted in mel
frames before the stride-2 convolution, keeps every frame of a shorter clip), and the held padding is a padded batch
(one run of real samples from the start of each row), its rows the call's or folded with other rows (fairseq's
`bsz * num_heads`: every way round the fold is read must keep a padded frame). Stays quiet on frames hidden that the stack calls real
(frames.py says that of an unpadded row), and where a layer's padding is not a number ("same"). The held padding may be
the script's top-level statement of its batch (details["held_top"]: the one its model call reads), where the model
reassigns its own to the frames before it attends (asappresearch/sew PR #2): the exact map of S to L says whose it is.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.frames import _key_padding
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _out(n: np.ndarray, layer: tuple) -> np.ndarray:
    k, s, p, d, ceil = layer
    room = n + 2 * p - d * (k - 1) - 1
    made = (-(-room // s) if ceil else room // s) + 1
    return np.maximum(np.where(room < 0, 0, made), 0)


def _stack(convs: tuple, samples: int, frames: int) -> list | None:
    """The layers (of one axis) whose first ones map `samples` to exactly `frames`; None where none do."""
    for axis in (0, 1):
        layers, n = [], np.array([samples])
        for each in convs:
            layer = each[axis]
            if layer[2] < 0:
                break
            layers.append(layer)
            n = _out(n, layer)
            if int(n[0]) == frames:
                return layers
            if int(n[0]) < frames:
                break
    return None


def _real_counts(held: dict, rows: int) -> tuple[int, np.ndarray] | None:
    """(S, each row's real samples) of a held padding that is right-padded over S samples; None otherwise."""
    found = held["rows"]
    if held["kind"] == "lengths":
        if found.ndim != 1 or found.size != rows or found.min() < 1 or found.min() == found.max():
            return None
        return int(found.max()), found.astype(np.int64)
    if held["kind"] not in ("keep", "pad") or found.ndim != 2 or found.shape[0] != rows:
        return None
    real = found.astype(bool) if held["kind"] == "keep" else ~found.astype(bool)
    count = real.sum(axis=1)
    at = np.arange(real.shape[1])[None, :]
    if count.min() < 1 or count.min() == real.shape[1] or not (real == (at < count[:, None])).all():
        return None
    return int(real.shape[1]), count.astype(np.int64)


def padded_frames_attended(run: Run) -> list:
    """Self-attention calls over frames whose key padding keeps frames the model's own convolutions computed from the
    padding the program holds over their samples."""
    square = [call for call in run.unmasked if call.api == "softmax" and call.shape[2] == call.shape[3] > 1]
    # (a softmax that masks nothing: the frame mask may call every frame real, wenet#1602's short row)
    return over_frames(run, [*run.calls, *square], _finding)


def over_frames(run: Run, calls: list, finding) -> list:
    """(call, finding) of each self-attention call over frames of a model call whose convolutions trace read, beside
    the sample padding the program holds (checks/madeframes.py reads them too): `finding(call, convs, helds, rows,
    k_len)`, read once per mask, placing and statement."""
    found, done = [], {}
    for call in calls:
        top = run.top(call)
        helds = [*(call.details.get("held_padding") or ()), *(call.details.get("held_top") or ())]
        # (a script's top-level statement of its batch too, handed to the model call: the exact map of its samples to
        # the call's frames through the model's own stack says it is this batch's)
        convs = None if top is None else top.arguments.get("convs")
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if not convs or not helds or call.stored is None or q_len != k_len or cross(call):
            continue
        key = (call.mask, call.shape, id(top), tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = finding(call, convs, helds, rows, k_len)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, convs: tuple, helds: list, rows: int, k_len: int) -> Finding | None:
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    union = np.broadcast_to(cells.any(axis=1), (rows, k_len, k_len))
    seen = _key_padding(union)  # (else a chunked, windowed or causal mask: the keys the row's real frames see, below)
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
        at = np.arange(k_len)[None, :]
        for each in _folds(size, rows):  # (a batch folded with its heads: every way round must hold the frames)
            keys = seen if seen is not None else (union & (at < made[each][:, None])[:, :, None]).any(axis=1)
            bads.append((each, keys & (at >= made[each][:, None])))
        if not all(bad.any() for _, bad in bads):
            continue
        each, bad = min(bads, key=lambda read: int(read[1].sum()))  # (the reading that keeps the fewest: the fold's own)
        r = int(np.argwhere(bad.any(axis=1))[0][0])
        b, keys = int(each[r]), [int(k) for k in np.flatnonzero(bad[r])]
        said = f"{held['name']} in {held['where']}"
        fold = "" if rows == size else f" (call row {r}: the batch of {size} folded with {rows // size} rows each)"
        stack = ", ".join(f"k{k}/s{s}" + (f"/p{p}" if p else "") for k, s, p, _, _ in layers)
        return Finding("padded-frames-attended", (
            f"batch row {b}{fold} has {int(real[b])} real samples of {samples} ({said}); the model's own strided layers "
            f"({stack}) make {int(made[b])} frames of them, yet this attention over the {k_len} frames keeps frames "
            f"{spans(keys)} of that row as real keys: {_made_of(keys, layers, int(real[b]))} (the frame mask reduced "
            f"from the sample mask another way than the convolutions count; the row alone has no such frames)"),
            expected=f"batch row {b}: frames 0-{int(made[b]) - 1} real", source=said, cell=(r, 0, keys[0]))
    return None


def _inputs(t: int, layers: list) -> tuple[int, int]:
    """The first and last input sample that frame `t` of the stack's output is computed from."""
    a, b = t, t
    for k, s, p, d, _ in reversed(layers):
        a, b = a * s - p, b * s - p + d * (k - 1)
    return a, b


def _made_of(keys: list, layers: list, n: int) -> str:
    """What the kept frames are computed from: wholly from the padding, or partly from the row's last real samples
    (samples 0..n-1) and partly from the padding (a reduction that reads each frame's first sample, wenet#1602)."""
    fields = [_inputs(t, layers) for t in keys]
    part = [t for t, (a, _) in zip(keys, fields) if a < n]
    said = f"frame {keys[0]} is computed from samples {max(fields[0][0], 0)}-{fields[0][1]}, the row's real ones end at {n - 1}"
    if not part:
        return f"frames computed wholly from the padding ({said})"
    if len(part) == len(keys):
        return f"frames computed partly from the row's last real samples and partly from the padding ({said})"
    return (f"frames computed from the padding, {spans(part)} of them partly from the row's last real samples "
            f"({said})")


def _folds(size: int, rows: int) -> list:
    """Each call row's batch row, every way the call's rows may fold a batch of `size` (none where they are the batch)."""
    at = np.arange(rows)
    return [at] if rows == size else [at // (rows // size), at % size]


def _out_all(n: np.ndarray, layers: list) -> np.ndarray:
    for layer in layers:
        n = _out(n, layer)
    return n


RULES = (
    Rule("padded-frames-attended", "wrong", "call", "a key padding over an encoder's frames that keeps frames its own "
         "strided convolutions computed from the padding the program holds over the samples (fairseq#3227, "
         "wenet#1602: the frame mask reduced another way than the convolutions count)", padded_frames_attended),
)
