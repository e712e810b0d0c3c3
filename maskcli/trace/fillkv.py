"""Keys whose K and V are each one constant, not zero, at an edge of an SDPA call's key axis: a buffer's fill.

trace/zerokv.py reads the keys whose K and V are exactly zero at an edge of the keys: a buffer row nobody wrote. A
buffer need not be made of zeros: `torch.full((MAX_LEN, H, D), 7.0)`, `torch.ones(...)`, `torch.empty(...).fill_(c)`
leave every slot nobody writes holding one value in every head and dimension. A projected token's key never is one
value throughout (a projection's output varies over its dimensions), so a run of such keys at an edge, K one constant
and V one constant (vLLM's DFlash drafter, vllm#47926: a context-KV buffer whose slots before the prefix-cache hit
were never written, attended whole), is the same unwritten buffer row. Read here and handed on as zerokv's table
(its "left" / "right" runs), with the fill values ("fill": per side, [K's, V's] or None): checks/zerokv.py says
where real queries see them, naming the fill.

Cheap where there is nothing to find: zero_kv runs first (most calls: no edge key zero, read cell by cell); then on
a CPU tensor the first two dimensions of each row's first and last key in every head are compared (a numpy view of
four cells a head), and only where some are equal is more read. A zero fill is zerokv's own; GPU tensors, bfloat16
and subclasses are not read here.
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.zerokv import _cells, _cpu, zero_kv


def edge_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape: tuple, mask=None, is_causal: bool = False,
            edges: bool | None = None) -> dict:
    """zero_kv's details (trace/zerokv.py), else those of a run of keys at an edge whose K and V are each one nonzero
    constant in every head and dimension (its table with "fill"), else {}. `edges`: as zero_kv's."""
    found = zero_kv(q, k, v, k_shape, mask, is_causal, edges)
    if found.get("zero_kv") or not 3 <= len(k_shape) <= 4 or k_shape[-2] < 3 or k_shape[-1] < 2:
        return found
    try:
        fill = _fill_kv(q, k, v, k_shape, mask, is_causal)
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, compiled, meta, sparse) holds no fill we can see
        return found
    return {**found, **fill} if fill else found


def _constant(cells: np.ndarray, at: int) -> float | None:
    """The one value key `at` holds in every row, head and dimension of (B, H, L, E) cells, where it is one and not
    zero (nor NaN); else None."""
    key = cells[:, :, at]
    value = float(key.flat[0])
    if value == 0 or value != value or not (key == key.flat[0]).all():
        return None
    return value


def _edges_equal(k: torch.Tensor, k_shape: tuple) -> bool | None:
    """Whether the first or the last key of batch row 0 and head 0 has its first two dimensions equal and not zero,
    four cells each read alone at its address (a fill is one value in every row and head of its edge key, so row 0's
    head 0 says whether one may be there); None where not read so (a tensor not a plain CPU one of a dtype read so)."""
    cells = _cells(k)  # (zerokv's reading of a plain CPU tensor cell by cell)
    if cells is None:
        return None
    read, _, base, strides, size = cells[:5]
    step = size * strides[-1]
    for at in (0, k_shape[-2] - 1):
        start = base + size * at * strides[-2]
        first = read(start).value
        if first != 0 and first == read(start + step).value:  # (a zero is no fill: _constant's own test, here first;
            return True  # a model whose padding embeds to 0, HF's padding_idx, has zero edge keys at every call)
    return False


def _fill_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape: tuple, mask, is_causal: bool) -> dict:
    """{"zero_kv": {... "fill": {"left": [K's, V's] or None, "right": ...}}} of the runs of one nonzero constant at
    an edge of the keys (every batch row's edge key that value: a buffer's fill is the same in every row), or {};
    with zerokv's "unwritten" where the buffer's last slots hold the fill (the queries are the written slots before
    them, masked or not: checks/context.queries)."""
    if _edges_equal(k, k_shape) is False:
        return {}  # (most calls: read cell by cell, no edge key holds one value in its first two dimensions)
    kc, vc = _cpu(k), _cpu(v)
    if kc is None or vc is None or vc.shape[2] != kc.shape[2] or vc.shape[-1] < 2:
        return {}
    length = kc.shape[2]
    ends = kc[:, :, :: length - 1, :2]  # (B, H, 2, 2): the first two dimensions of each edge key
    if not (ends[..., 0] == ends[..., 1]).any():
        return {}  # (the common case: no edge key holds one value in its first two dimensions)
    table, fills, unwritten = None, {"left": None, "right": None}, {}
    for side, at in (("left", 0), ("right", length - 1)):
        k_fill, v_fill = _constant(kc, at), _constant(vc, at)
        if k_fill is None or v_fill is None:
            continue
        read = zero_kv(q, k - k_fill, v - v_fill, k_shape, mask, is_causal)
        if side == "right" and "unwritten" in read:  # (a static buffer's fill past its written slots, masked or
            unwritten = {"unwritten": read["unwritten"]}  # not: the queries are the last written ones, as zerokv's)
        shifted = read.get("zero_kv")
        if not shifted or not any(run >= 2 for run in shifted[side]):
            continue
        other = "right" if side == "left" else "left"
        if table is None:
            table = {**shifted, other: [0] * len(shifted[other])}
            table.pop("heads", None)
        else:
            table[side] = shifted[side]
        fills[side] = [k_fill, v_fill]
    if table is None:
        return unwritten
    table["fill"] = fills
    return {"zero_kv": table, **unwritten}
