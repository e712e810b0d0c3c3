"""Score rows the program filled whole, then shifted by their own largest value before a softmax written by hand.

A hand-written softmax subtracts each row's largest score before `exp` (`S - S.amax(-1, keepdim=True)`, an online
softmax's `exp(s - m_new[..., None])`). A row whose every cell was filled low (-inf, the dtype's lowest, a finite fill
of at most -1e4: what masks.py reads as masked) becomes all 0 there, so `exp` of it reads as a row that sees every key,
though the mask hid all of them (h-transformer-1d 5385d15: an all-True keep mask filled where True, every score
filled, uniform attention after the shift). Where a subtraction's first operand is scores and its second one value per
row (last axis 1), the rows filled whole are noted on its result (Scores.shifted) and read as seeing no key at the
`exp` that follows (masks.py's exp_reader), or at a softmax of it (`shifted_reader`: Flamingo's MaskedCrossAttention
shifts `sim - sim.amax(-1, keepdim=True)` before `sim.softmax(-1)`, so a text token before the first image, every latent
filled with -max, read as seeing every latent: flamingo-mini 196c64b). Rows partly filled keep their fill below their
real scores: read as before.
"""

from __future__ import annotations

import torch

SUBS = {torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.subtract}
LOW = -1e4  # a fill at most this masks (checks/fills.py's finite fill)
MOST = 1 << 22  # score cells read at most


def filled_rows(func, args: tuple, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """Bool (.., Lq) rows of scores `x` filled low in every cell, where `out` = x minus one value per row; else None."""
    if func not in SUBS or len(args) < 2 or args[0] is not x or not isinstance(args[1], torch.Tensor) \
            or args[1].dim() != x.dim() or args[1].shape[-1] != 1 or out.shape != x.shape \
            or not x.is_floating_point() or x.numel() > MOST:
        return None
    rows = (x.detach() <= LOW).all(dim=-1)
    return rows if bool(rows.any()) else None


def hide(seen, rows: torch.Tensor) -> None:
    """Read the rows filled whole as seeing no key in `seen` (masks.py's Seen of the exp, its keep (B, H, Lq, Lk))."""
    keep = seen.keep
    if keep is None or rows.dim() not in (2, 3) or rows.shape[-1] != keep.shape[2]:
        return
    rows = rows if rows.dim() == 3 else rows[:, None]
    seen.keep = keep & ~rows.reshape(rows.shape[0], -1, rows.shape[-1])[..., None].expand_as(keep).to(keep.device)


def shifted_reader(reader, scores, given):
    """`reader` of a softmax over scores less their row max (Scores.shifted), reading the rows filled whole as seeing no
    key; `reader` itself for any other input."""
    held = scores.shifted.get(id(given)) if scores.shifted else None
    if held is None or held[0]() is not given:
        return reader

    def shifted(args, kwargs):
        seen = reader(args, kwargs)
        if seen is not None and "axes" not in seen.details:
            hide(seen, held[1])
            seen.details["fill"] = seen.details.get("fill") or "finite"  # (filled low, then made 0 by the shift: the
        return seen  # softmax weighs such a row's keys alike, as a finite fill does)

    shifted.api = getattr(reader, "api", "softmax")
    return shifted
