"""Kernel positions that are no tokens: queries or keys viewed out of a (B, L, H·D) projection with heads before positions.

A projection's output (B, L, E), E = H·D (or sequence-first (L, B, E)), becomes the kernel's (B, H, L, D) by a view to
(B, L, H, D) and a transpose. Viewed straight to (B, H, L, D) (`.view(B, H, L, -1)` of a (B, L, H, D) tensor:
Informer2020 7f8b80c), the kernel's position l of head h holds features of token (h·L + l)·D // E: one token's heads
become positions, and a plane holds L / H tokens. The tensor handed to the kernel says so itself: a view of that output
(its `_base`) whose step along the kernel's position axis is less than one token of it, and whose feature axis is a
head's slice of one token, while the axis counts as many positions as the output has tokens. Read at each attention
call from shapes and strides alone (no hook on views): checks/regrouped.py. The transpose missing altogether, a
(B, L, H, D) view handed where (B, H, L, D) is read (`swapped`), steps one token along the kernel's head axis and one
head along its positions; the head count the attention's own module states is read then only (trace/queried.py's
`own_heads`).

A `.reshape` that cannot view (K and V sliced off a fused (B, L, 2·E) projection first, tgm#168's TGAT
`K.reshape(B, n_heads, -1, head_dim)`) copies, and its copy's strides say nothing: `reshaped` notes such a copy where a
reshape makes it (a 3-D (B, L, E) to (B, H, L, D), H·D = E, H > 1: the same regrouping), and the kernel reads the
note where its operand is that copy or a view of it along the same positions.
"""

from __future__ import annotations

import weakref

import torch

_COPIES: dict[int, tuple] = {}  # id -> (a weak reference, its fact) of reshapes copied with heads before positions
_KEEP = 64


def regrouped(t, axis: int) -> dict | None:
    """{"tokens", "row", "step", "held"} where kernel tensor `t` (B, .., L, D)'s positions (its `axis`; its features the
    other of its last two) step inside the tokens of the buffer of rows it is a view of (a projection's (B, L, E), or
    its (B·L, E) as nn.Linear makes it), a sample's rows as many as its positions: "held" lists, for positions 0 .. 3 of
    its first plane, (token, first feature) of the sample. None where its positions are that buffer's rows, or where
    `t` is no view of one."""
    base = t._base if isinstance(t, torch.Tensor) else None
    if isinstance(t, torch.Tensor) and (base is None or base.dim() == 4):
        fact = _copied(t, axis)
        if fact is not None:
            return fact
    if base is None or t.dim() < 3 or base.dim() not in (2, 3):
        return None
    step, row = t.stride(axis), base.stride(-2)
    if not 0 < step < row:
        return None  # (positions a row apart: the transpose, every layout that steps whole tokens; read first, cheap)
    length, feature = t.shape[axis], -1 if axis in (-2, t.dim() - 2) else -2
    sample = t.stride(0)
    folded = _folded(t, base, length, row)
    if folded:  # (B·H, L, D) viewed straight from (B, L, H·D): H planes a sample, each plane's stride a sample's 1/H
        sample *= folded
    if length < 2 or base.stride(-1) != 1 or row != base.shape[-1] or t.stride(feature) != 1 \
            or t.shape[feature] >= row or sample % row or sample // row != length or not t.is_floating_point():
        return None  # (rows that are no sample's tokens, or a sample's rows not its positions)
    offset = (int(t.storage_offset()) - int(base.storage_offset())) % sample
    held = [((offset + i * step) // row, (offset + i * step) % row) for i in range(min(length, 4))]
    return {"tokens": length, "row": row, "step": step, "held": held}


def _folded(t, base, length: int, row: int) -> int:
    """H where `t` (B·H, L, D) folds H planes of each sample of the buffer (B·L rows of `row` features, as many rows a
    sample as `t` has positions: its numel B·L·row, or (B, L, row) where it is 3-D) into its first axis, each plane a
    contiguous 1/H of the sample spanning more than one token (FuxiCTR#30: `query.view(batch_size * num_heads, -1,
    attention_dim)`); 0 for any other layout. A plane of one token or less is the same view as each token's heads laid
    as positions ((B·L, H, D): an attention over a token's heads), which a buffer of rows cannot tell apart: left."""
    if t.dim() != 3 or length < 2 or t.stride(0) <= row or base.dim() == 3 and base.shape[1] != length:
        return 0
    samples = base.numel() // (length * row)
    if samples < 1 or samples * length * row != base.numel() or t.shape[0] % samples:
        return 0
    heads = t.shape[0] // samples
    return heads if heads > 1 and t.stride(0) * heads == length * row else 0


def reshaped(args: tuple, out) -> None:
    """At a reshape: note `out` where it copied a (B, L, E) to (B, H, L, D) (module docstring). Cheap shape tests first;
    a reshape that views is read off its strides at the kernel instead."""
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or out._base is not None or not args:
        return
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        return
    fact = _split(tuple(x.shape), tuple(out.shape))
    if fact is not None:
        if len(_COPIES) >= _KEEP:
            _COPIES.clear()
        _COPIES[id(out)] = (weakref.ref(out), fact)


def _split(given: tuple, out: tuple) -> dict | None:
    """The fact of a (B, L, E) reshaped to (B, H, L, D), H·D = E, H > 1; None for any other pair of shapes."""
    if len(given) != 3 or len(out) != 4:
        return None
    batch, heads, length, width = out
    if batch != given[0] or length != given[1] or length < 2 or heads < 2 or heads == length \
            or heads * width != given[2]:
        return None  # ((B, L, H, D): the heads after the positions, as meant; an H equal to L cannot tell them apart)
    row = given[2]
    held = [((i * width) // row, (i * width) % row) for i in range(min(length, 4))]
    return {"tokens": length, "row": row, "step": width, "held": held, "copied": True}


def _copied(t, axis: int) -> dict | None:
    """The fact of a reshape copy `t` is (or views) where `axis` of `t` is the copy's positions: noted at the reshape
    where the mode saw it, or read off the copy's autograd node (a reshape that copied: an _unsafe_view of a clone,
    which saves the shape it was handed) where the program records gradients."""
    if t.dim() != 4:
        return None
    for source in (t, t._base):
        if source is None or source.dim() != 4 or t.shape[axis] != source.shape[2] or t.stride(axis) != source.stride(2):
            continue
        held = _COPIES.get(id(source))
        if held is not None and held[0]() is source:
            return held[1]
        node = source.grad_fn
        if node is not None and type(node).__name__ == "UnsafeViewBackward0" and node.next_functions \
                and type(node.next_functions[0][0]).__name__ == "CloneBackward0":
            try:
                given = tuple(node._saved_self_sym_sizes)
            except (AttributeError, RuntimeError):  # (a torch that names it otherwise, or a node freed by backward)
                return None
            return _split(given, tuple(source.shape))
    return None


def einsum_axes(equation) -> tuple | None:
    """(the query's position axis, the key's) of a q @ kᵀ einsum ("bhld,bhnd->bhln": (-2, -2)); None if not read."""
    if not isinstance(equation, str) or "->" not in equation or "..." in equation:
        return None
    given, out = equation.replace(" ", "").split("->")
    parts = given.split(",")
    if len(parts) != 2 or len(out) < 2 or out[-2] not in parts[0] or out[-1] not in parts[1]:
        return None
    axes = parts[0].index(out[-2]) - len(parts[0]), parts[1].index(out[-1]) - len(parts[1])
    return axes if all(axis in (-2, -1) for axis in axes) else None  # (positions among the last two axes, as read)


def swapped(t, axis: int) -> dict | None:
    """{"tokens", "heads", "row", "step", "held"} where 4-D kernel tensor `t` (B, A, P, D) (its positions `axis`, its
    features the other of its last two) is a view of a buffer of rows (a projection's (B, L, H·D), or nn.Linear's
    (B·L, H·D)) laid (B, L, H, D): its head axis A steps one row, a sample's L tokens, and its positions P step one
    head's D features, the H heads of one token (or of its part of a fused row) (Stylish-TTS b97a5b6: `b n h d` handed
    to SDPA, which reads `b h n d`). None for any other layout; shapes and strides alone. "held": (token, first
    feature) of positions 0 .. 3 of its first plane."""
    base = t._base if isinstance(t, torch.Tensor) else None
    if base is None or t.dim() != 4 or base.dim() not in (2, 3):
        return None
    step, row = t.stride(axis), base.stride(-2)
    if not 0 < step < row or t.stride(1) != row:
        return None  # (positions a row apart, or a head axis that is no token axis: read first, cheap)
    length, feature = t.shape[axis], -1 if axis in (-2, 2) else -2
    tokens = t.shape[1]
    if length < 2 or tokens < 2 or base.stride(-1) != 1 or row != base.shape[-1] or t.stride(feature) != 1 \
            or t.shape[feature] != step or length * step > row or t.stride(0) != tokens * row \
            or not t.is_floating_point():
        return None  # (positions that are not the heads of one token, or a head axis that is not a sample's tokens)
    offset = (int(t.storage_offset()) - int(base.storage_offset())) % t.stride(0)
    held = [((offset + i * step) // row, (offset + i * step) % row) for i in range(min(length, 4))]
    return {"tokens": tokens, "heads": length, "row": row, "step": step, "held": held}


def operands(q, k, turned: bool, axes: tuple | None = None) -> dict:
    """{"regrouped": {"query" or "key": regrouped(...)}} of a q @ kᵀ (kᵀ `turned`: its positions last) or SDPA's q, k;
    {"heads_swapped": {"query" or "key": swapped(...)}} where they are laid (B, L, H, D); `axes`: the query's and key's
    position axes where an einsum states them."""
    found, flipped = {}, {}
    q_axis, k_axis = axes if axes is not None else (-2, -1 if turned else -2)
    for name, tensor, axis in (("query", q, q_axis), ("key", k, k_axis)):
        fact = swapped(tensor, axis)
        if fact is not None:
            flipped[name] = fact
        elif (fact := regrouped(tensor, axis)) is not None:
            found[name] = fact
    return {**({"regrouped": found} if found else {}), **({"heads_swapped": flipped} if flipped else {})}


class Pending:
    """The last q @ kᵀ whose operands were regrouped, until a softmax over scores of its shape reads it."""

    def __init__(self):
        self.pending = None  # (the scores' shape, operands' facts)

    def note(self, q, k, out, axes: tuple | None = None) -> None:
        """At each q @ kᵀ: its fact, or none (a later product's softmax never reads an earlier one's)."""
        fact = operands(q, k, turned=True, axes=axes)
        self.pending = (tuple(out.shape), fact) if fact and isinstance(out, torch.Tensor) else None

    def of(self, x, call, seen) -> None:
        """At softmax `call` over scores `x`: details["regrouped"] where the product just noted made scores of its shape
        (or details["heads_swapped"], its "stated" the head count the softmax's own module states: own_heads)."""
        pending, self.pending = self.pending, None
        if pending is not None and isinstance(x, torch.Tensor) and tuple(x.shape) == pending[0]:
            if "heads_swapped" in pending[1]:
                pending[1]["heads_swapped"]["stated"] = seen.details.get("own_heads")
            call.details.update(pending[1])
            seen.details.update(pending[1])

