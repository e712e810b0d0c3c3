"""A fill the program wrote into its scores, lifted back before the softmax by a bounded map: tanh(-inf) = -1.

A masked cell is one the program filled low (-inf, the dtype's lowest, a finite fill of at most -1e4: what
checks/fills.py reads as masked). A map of the scores that bounds them from below (tanh, sigmoid, atan, softsign,
hardtanh, a clamp) turns that fill into an ordinary score: Perceiver-VL's CrossAttention applied `torch.tanh` after
`masked_fill(~mask, -inf)`, so each padded key scored -1 and kept its softmax weight (zinengtang/Perceiver_VL#2).
Recorded on the map's output as weakfill.py records a fill of about zero, (the value the fill became, the cells,
what undid it), and carried alike to the softmax, where `weak_filled` keeps the cells the softmax weighs within
SPAN of its row's largest real score (a soft cap of 50 after the mask leaves them at e^-50: masked still). Rows the
fill covers whole are left out (a NaN guard's uniform row is no lifted mask). Read only where the map meets scores
holding such a fill: no cost elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BOUNDED = {torch.tanh: "tanh", torch.Tensor.tanh: "tanh", F.tanh: "tanh", torch.sigmoid: "sigmoid",
           torch.Tensor.sigmoid: "sigmoid", F.sigmoid: "sigmoid", torch.atan: "atan", torch.Tensor.atan: "atan",
           F.softsign: "softsign", F.hardtanh: "hardtanh", torch.clamp: "clamp", torch.Tensor.clamp: "clamp",
           torch.clip: "clamp", torch.Tensor.clip: "clamp"}
LOW = -1e4  # a fill at most this masks (checks/fills.py's finite fill)
SPAN = 10.0  # a lifted cell within this of its row's largest real score keeps at least e^-10 of its weight
MOST = 1 << 22  # score cells read at most


def lifted(weak: dict, func, x: torch.Tensor, out: torch.Tensor) -> None:
    """Note on `out` the cells of scores `x` filled low that `func`, a bounded map, lifted to one ordinary value."""
    if func not in BOUNDED or x.shape != out.shape or not x.is_floating_point() or x.numel() > MOST:
        return
    with torch.no_grad():
        cells = x.detach() <= LOW
        cells = cells & ~cells.all(dim=-1, keepdim=True)  # (rows filled whole: left to the rules on empty rows)
        if not cells.any():
            return
        before, now = x.detach()[cells], out.detach()[cells]
        if not bool((before == before[0]).all()) or not bool((now == now[0]).all()) \
                or not bool(torch.isfinite(now[0])) or float(now[0]) <= LOW:
            return
        weak[id(out)] = (float(now[0]), cells.clone(), {"fill": float(before[0]), "by": BOUNDED[func]})


def near_real(x: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """The lifted `cells` of softmax input `x` within SPAN of their row's largest real (unfilled) score."""
    with torch.no_grad():
        x = x.detach().float()
        real = x.masked_fill(cells, float("-inf")).amax(dim=-1, keepdim=True)
        return cells & (x >= real - SPAN)
