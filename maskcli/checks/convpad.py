"""Padded frames a convolution mixes into real ones, where the layer's own attention masks them as padding.

A Conformer layer masks its batch's padding in self-attention (a key padding mask, a (B, 1, T) mask, lengths) and
runs a convolution module over the same T frames: a depthwise Conv1d of kernel K reads (K - 1) / 2 frames past each
output frame, so a row's last real frames read its padded frames unless the program zeroed them first. Where it did
not, whatever the padded frames hold (padded features, attention's output at padded queries, a feed-forward's)
reaches the real frames, and a row's result depends on what it was padded with and on the batch it ran in
(wenet#223: ConvolutionModule given no `mask_pad`; pytorch/audio#4205: `_ConvolutionModule` never given the
`key_padding_mask` its layer's MultiheadAttention masks).

The padding is what the model's own attention masks, per batch row: the keys of a row that no query of the row, in
any head, sees, where they are the row's last ones (right padding: keys [L, T)). A convolution of the same model call
over (B, C, T) frames of the same B and T (recorded by trace/convpad.py: stride 1, reaching past a frame) mixes
padding in where a row's padded frames are not one constant frame (zeros, or one constant a bias made of zeros, carry
nothing of the padding; frames that differ do). A convolution of other rows or frames is placed where the model call's
own 2-D mask over its (B, T) frames states the attention's padding: its frames the attention's last T keys (register or
speaker tokens put before them), its rows the attention's first B, repeated (a classifier-free guidance batch:
voicebox-pytorch d079b26, F5-TTS a051a68). Quiet on causal convolutions (they read no later frame), strided ones
(subsampling: checks/subsampled.py), left padding, calls whose rows all see every key, cross-attention.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _lengths(call) -> tuple | None:
    """Each row's real keys L where the keys no query of the row sees (any head) are its last ones [L, T), and some
    row is padded; else None."""
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, call.shape[0]):
        return None
    seen = cells.any(axis=(1, 2))  # (b, Lk): a key some query of the row sees, in some head
    lengths = []
    for row in seen:
        real = int(row.sum())
        if real == 0 or not row[:real].all():
            return None  # (a row that sees nothing, or hides keys among its real ones: no right padding)
        lengths.append(real)
    if len(lengths) == 1:
        lengths = lengths * call.shape[0]
    return tuple(lengths) if min(lengths) < call.shape[3] else None


def padding_convolved(run: Run) -> list:
    """Self-attention calls whose key padding a time-mixing convolution of the same model call reads as content."""
    found = []
    for top in run.tops:
        if not top.convs:
            continue
        done = {}
        for call in run.made_by(top):
            b, _, q_len, k_len = call.shape
            if q_len != k_len:
                continue
            key = (call.mask, call.shape)
            if key not in done:
                lengths = _lengths(call)
                done[key] = None if lengths is None else _finding(lengths, top.convs, b, k_len)
            if done[key] is not None:
                found.append((call, done[key]))
    return found


def _rows(lengths: tuple, frames: int, conv: dict) -> tuple | None:
    """Each of `conv`'s rows' real frames, from the attention's per-row key lengths over `frames` keys: the same rows
    and frames as they are; else where the program states the convolution's own (B, T) frames padded as the attention
    masks them (a 2-D mask argument of the model call whose real frames are a prefix of each row: trace/convpad.py's
    `stated`), its frames the attention's last T keys (tokens put before them: a model's register or prompt tokens
    the attention's mask pads as real) and its B rows the attention's first (the attention's rows those B repeated: a
    classifier-free guidance batch, conditional and unconditional). None where they cannot be placed so."""
    rows, length = len(conv["tails"]), conv["frames"]
    if (rows, length) == (len(lengths), frames):
        return lengths
    if not rows or len(lengths) % rows or lengths != lengths[:rows] * (len(lengths) // rows) or length > frames:
        return None
    placed = tuple(n - (frames - length) for n in lengths[:rows])
    if min(placed) < 1 or ((rows, length), placed) not in conv.get("stated", ()):
        return None
    return placed


def _finding(lengths: tuple, convs: tuple, batch: int, frames: int) -> Finding | None:
    for conv in convs:
        tails, placed = conv["tails"], _rows(lengths, frames, conv)
        if placed is None:
            continue
        length = conv["frames"]
        rows = [b for b, (n, tail) in enumerate(zip(placed, tails)) if n < length and tail > n]
        if not rows:
            continue
        b = rows[0]
        n, reach = placed[b], conv["reach"]
        last = min(length, n + reach) - 1
        before = frames - length  # (keys before the convolution's frames: none where they are the same)
        where = f"the same {frames} frames"
        if (len(tails), before) != (batch, 0):
            keys = f"the attention's last {length} keys" if before else f"the attention's {frames} keys"
            some = f"its first {len(tails)} rows, repeated in its {batch}" if len(tails) != batch else "its rows"
            where = (f"{length} frames, {keys} of {some}, as the model call's own ({len(tails)}, {length}) mask "
                     f"states them")
        return Finding("padding-convolved", (
            f"batch row {b}: real frame {n - 1} is convolved with padded frames {n}..{last} (a Conv1d of kernel "
            f"{conv['kernel']}, padding {conv['padding']}, dilation {conv['dilation']}, over {where}), which the "
            f"model's own attention masks as padding (keys {n + before}..{frames - 1} of the row), and "
            f"the padded frames carry content (they are not one constant frame; {len(rows)} row"
            f"{'s' * (len(rows) != 1)} so) — the padding mask not handed to the convolution module?"),
            expected=f"the padded frames zeroed before the convolution (row {b}: frames {n}..{length - 1})",
            source="the attention mask's key padding", cell=(b, n + before - 1, n + before))
    return None


RULES = (
    Rule("padding-convolved", "wrong", "steps", "a time-mixing convolution (a Conformer's depthwise Conv1d, a TTS model's "
         "convolutional position embedding) reads "
         "padded frames that carry content into real ones, where the same model call's self-attention masks them as "
         "padding (wenet#223, pytorch/audio#4205: the conv module never given the padding mask)", padding_convolved),
)
