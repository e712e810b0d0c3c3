"""The positions a call's queries were rotated at: read off the (cos, sin) factors the program multiplied them by.

A rotary embedding multiplies the queries and keys by a cos factor and their half-turned copy by a sin factor
(`q * cos + rotate_half(q) * sin`), the factors gathered for the positions it was handed (`cos[position_ids]`, or
computed from them). Those factors are the only place the positions the program actually used can be read: a
frame's `position_ids` says what it was handed, not what it rotated with (SpecForge#424 rotated every TTT step with
`position_ids`, its frame holding the table for `position_ids + lck`).

Each product of a tensor by a smaller, broadcast factor of the same last dimension that needs no gradient (what a
rotary factor is; an MLP's products are of equal shapes, a norm's weight is 1-D or needs a gradient) keeps two
columns of each row of that factor: those the lowest rotary frequency and a middle one sit in, for the two layouts
a table holds (`cat(freqs, freqs)`, or one column a frequency). O(L) a product, nothing per token in Python; the
last few are kept and read at the next attention call whose queries are as many as the factor's rows, then let go
(a factor of an earlier call is never read at a later one). With the frequencies of a module a program frame's
`self` holds (ropeat.py's), a pair whose cos² + sin² is 1 gives each row's positions: atan2 at the lowest frequency,
another column agreeing. checks/positioned.py compares them step to step.
"""

from __future__ import annotations

from collections import deque

import torch

import maskcli.trace.ropeat as ropeat
import maskcli.trace.rotatedkeys as rotatedkeys

HELD = 8


def _columns(width: int) -> list:
    return sorted({width // 2 - 1, width // 4, width - 1, width // 2})


class Rotations:
    """The last few broadcast factors the program multiplied by: (shape, columns kept, (…, L, 4) on its device)."""

    def __init__(self):
        self.held: deque = deque(maxlen=HELD)

    def note(self, args: tuple, out) -> None:
        """Keep a product's broadcast factor (whatever goes wrong here is the watch's: let go)."""
        try:
            if len(args) != 2 or type(out) is not torch.Tensor:
                return
            a, b = args
            if type(a) is not torch.Tensor or type(b) is not torch.Tensor:
                return
            for x, y in ((b, a), (a, b)):
                width = x.shape[-1] if x.dim() >= 2 else 0
                if width >= 4 and width % 2 == 0 and not x.requires_grad and x.is_floating_point() \
                        and width == out.shape[-1] and x.numel() < out.numel() and y.shape == out.shape \
                        and x.device.type != "meta" \
                        and (x.shape[-2] == out.shape[-2] or _heads_last(x, out) or x.numel() == width):
                    with torch._C.DisableTorchFunction():  # (the factor itself, its version beside it: four of its
                        factor = x.detach()  # columns are read at the next attention call, where they are a pair's;
                        if x.shape[-2] != out.shape[-2] and _heads_last(x, out):  # (tokens before heads: put where HF's are)
                            factor = factor.transpose(-3, -2)
                    self.held.append((tuple(factor.shape), _columns(width), factor, factor._version,  # (a factor
                                      _spread(x, out)))  # changed in place since is let go)
                    return
        except Exception:  # noqa: BLE001 - the program's product is computed already; nothing reaches it
            return

    def take(self, rows: int, keys: int = -1) -> tuple[list, list, list]:
        """The factors kept since the last call, unchanged since, of `rows` rows each (the call's queries), of `keys`
        rows each (its keys, where they are more), and of one rotation spread over many tokens; the rest let go."""
        kept = [entry for entry in self.held if entry[2]._version == entry[3]]
        self.held.clear()
        return [e for e in kept if e[0][-2] == rows], [e for e in kept if e[0][-2] == keys != rows], \
            [e for e in kept if e[4]]


def _spread(x: torch.Tensor, out: torch.Tensor) -> tuple:
    """The sizes of the product's axes a factor of one rotation (one row on every axis but its width) is broadcast
    over: the tokens it gives one position to, among the batch and the heads."""
    if x.numel() != x.shape[-1]:
        return ()
    return tuple(out.shape[a] for a in range(-out.dim(), -1) if (x.dim() < -a or x.shape[a] == 1) and out.shape[a] > 1)


def _heads_last(x: torch.Tensor, out: torch.Tensor) -> bool:
    """A factor laid (…, tokens, 1, width) over (…, tokens, heads, width): keras-hub's `[None, :, None, :]`."""
    return x.dim() >= 3 and x.shape[-2] == 1 < out.shape[-2] and x.shape[-3] == out.shape[-3]


def _read(cos: torch.Tensor, sin: torch.Tensor, cols: list, width: int, freqs: tuple) -> torch.Tensor | None:
    """Positions (…, L) of a cos/sin pair's kept columns, or None where they are no rotary table of these frequencies."""
    inv, factor = freqs
    n = inv.numel()
    if width == 2 * n:
        low, mid = n - 1, n // 2
    elif width == n:
        low, mid = n - 1, n // 2
    else:
        return None
    if int(torch.argmin(inv)) != n - 1 or low not in cols or mid not in cols:
        return None
    c, s = cos[..., cols.index(low)], sin[..., cols.index(low)]
    if (c * c + s * s - 1).abs().max() > 1e-3 or (cos[..., cols.index(mid)] ** 2 + sin[..., cols.index(mid)] ** 2
                                                   - 1).abs().max() > 1e-3:
        return None
    at = torch.atan2(s, c) / float(inv[low])
    turned = at * float(inv[mid])
    if (torch.cos(turned) - cos[..., cols.index(mid)]).abs().max() > 0.05 \
            or (torch.sin(turned) - sin[..., cols.index(mid)]).abs().max() > 0.05:
        return None
    return torch.round(at * factor)


def note(details: dict, rotations: Rotations, walked, shape: tuple) -> None:
    """details["rotated_at"] at a call whose queries were just rotated: {"rows": each row's first and last query's
    position and their sum (one row for all where the factor has one), "module": the id of the attention's module
    (`self` of the innermost program frame)}; and ropeat.py's table first."""
    try:
        ropeat.note(details, walked, shape)
    except Exception:  # noqa: BLE001 - each reader alone (sites.guarded): the table's left out, not the factors
        pass
    if len(shape) != 4 or not rotations.held:
        return
    found, keyed, flat = rotations.take(int(shape[2]), int(shape[3]))
    if keyed:  # (its keys rotated again beside its queries: which key each query was rotated like)
        rotatedkeys.note(details, found, keyed)
    if flat:  # (one rotation over many of its tokens)
        rotatedkeys.flat(details, flat, shape)
    if found:  # (its queries and its own keys rotated by two tables a shift apart)
        rotatedkeys.shifted(details, found)
    if not found or walked is None or not walked.held:
        return
    freqs = next((f for f in (ropeat._frequencies(held.f_locals.get("self")) for held, _ in walked.held) if f), None)
    if freqs is None:
        return
    for i in range(len(found) - 1):
        (shape_c, cols, *_), (shape_s, *_) = found[i], found[i + 1]
        if shape_c != shape_s:
            continue
        cos, sin = rotatedkeys.kept(found[i]), rotatedkeys.kept(found[i + 1])
        at = _read(cos, sin, cols, shape_c[-1], freqs)
        if at is None:
            continue
        at = at.reshape(-1, at.shape[-1]).to(torch.int64)  # (planes, L)
        if not bool((at == at[:1]).all()) and at.shape[0] % int(shape[0]):
            return
        per_row = at[:: max(1, at.shape[0] // int(shape[0]))][: int(shape[0])] if at.shape[0] >= shape[0] else at[:1]
        owner = walked.held[0][0].f_locals.get("self")
        details["rotated_at"] = {"rows": torch.stack([per_row[:, 0], per_row[:, -1], per_row.sum(dim=1)], 1).tolist(),
                                 "module": id(owner) if owner is not None else None}
        return
