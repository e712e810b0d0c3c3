"""The positions a sinusoidal encoding added to a model's inputs places its tokens at (positions-vs-keys).

A model that adds the fixed sinusoidal encoding of "Attention Is All You Need" to its embeddings (OpenNMT's
`PositionalEncoding`, its slice `pe[step]` at a decoding step; tensor2tensor's timing signal) states each token's
position only in the values it adds: the frame that chose the step is gone before attention runs (OpenNMT-tf#498 and
OpenNMT-py#2099 numbered a generated token from 1 after a prompt of L, behind the keys it cached). A sum whose one
operand is such an encoding (broadcast over the batch, or a slice of a larger table: a positional buffer's rows) is
read here: its rows' (sin, cos) pairs, interleaved or in halves, whose squares sum to 1, at the frequencies
10000^(-2i/d) (interleaved) or 10000^(-i/(d/2 - 1)) (halves), read back as whole positions, each row checked in every
column against the encoding it implies. Kept per thread as the model's table positions (trace/tables.py), one
encoding a model call: a model call that adds two of different lengths (an encoder's and a decoder's) states none.
O(L * d) a read; the cheap shape tests first, so the residual stream's sums (of equal shapes) are never read.
"""

from __future__ import annotations

import math

import numpy as np
import torch

MOST = 4096  # rows of an encoding read at most
BASE = 10000.0


def candidate(args: tuple, out) -> bool:
    """Whether a sum may add a position encoding, by shapes alone (trace/entry.py asks it of every sum a model runs
    that may not overflow)."""
    return _operand(args, out) is not None


def _operand(args: tuple, out) -> torch.Tensor | None:
    """The operand of a sum that may be a position encoding: it needs no gradient, has the result's width, and is
    broadcast over the other or a slice of a larger tensor."""
    if len(args) != 2 or type(out) is not torch.Tensor or out.dim() < 2:
        return None
    a, b = args
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor \
            or a.shape == b.shape and a._base is None and b._base is None:  # (a residual's sum: the common case)
        return None
    width = out.shape[-1]
    if width < 8 or width % 4:
        return None
    for x, y in ((b, a), (a, b)):
        if not x.requires_grad and x.shape[-1] == width and (x.dim() < y.dim() or x.numel() < y.numel() or x._base
                                                              is not None and x._base.numel() > x.numel()):
            return x
    return None


def note(local, args: tuple, out) -> None:
    """Keep the positions of a sinusoidal encoding one operand of this sum holds (whatever goes wrong: let go)."""
    try:
        x = _operand(args, out)
        if x is None or not x.is_floating_point() or x.device.type == "meta":
            return
        rows = _rows(x.detach())
        at = None if rows is None or rows.shape[0] > MOST else positions(rows)
        if at is not None:
            kept = local.__dict__.setdefault("tables", {}).setdefault("sinusoid", [])
            if len(kept) >= 16:  # (a program without a model call to take them: the last few kept)
                del kept[0]
            kept.append(at[None, :])
    except Exception:  # noqa: BLE001 - the program's sum is made already; nothing reaches it
        return


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """(L, d): the encoding's one row per token, whatever axes broadcast it (batch-first (1, L, d), sequence-first
    (L, 1, d), (L, d) or one row (d,)); None where it varies along another axis than its tokens'."""
    shape = [n for n in x.shape[:-1] if n > 1]
    if len(shape) > 1:
        return None
    return x.reshape(-1, x.shape[-1])


def positions(rows: torch.Tensor) -> np.ndarray | None:
    """int64 (L,): the whole positions a sinusoidal encoding's rows stand for, or None where they are no such encoding."""
    v = rows.double().cpu()
    width = v.shape[-1]
    half = width // 2
    for sin, cos, freqs in ((v[:, 0::2], v[:, 1::2], BASE ** (-torch.arange(half, dtype=torch.float64) * 2 / width)),
                            (v[:, :half], v[:, half:], BASE ** (-torch.arange(half, dtype=torch.float64) / (half - 1)))):
        if float((sin * sin + cos * cos - 1).abs().max()) > 1e-3:
            continue
        slow = torch.remainder(torch.atan2(sin[:, -1], cos[:, -1]), 2 * math.pi)  # (its lowest frequency: one turn in
        at = torch.round(slow / freqs[-1])  # some 60,000 positions)
        fast = torch.atan2(sin[:, 0], cos[:, 0])  # (frequency 1: the whole position, to the radian)
        at = at + torch.round(torch.remainder(fast - at + math.pi, 2 * math.pi) - math.pi)
        angles = at[:, None] * freqs[None, :]
        if float((torch.sin(angles) - sin).abs().max()) < 2e-3 and float((torch.cos(angles) - cos).abs().max()) < 2e-3:
            return at.numpy().astype(np.int64)
    return None


def taken(held: dict) -> np.ndarray | None:
    """The one encoding's positions a model call added (popped), or None where it added none or two of other lengths."""
    found = held.pop("sinusoid", None)
    if not found or len({a.shape for a in found}) != 1:
        return None
    return found[-1]
