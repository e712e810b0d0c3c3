"""Keys whose K and V are exactly zero at an edge of an SDPA call's key axis: the data's own padding.

A key row that is zero in every head and every dimension of both K and V is not a token: it is a buffer row nobody
wrote (whisper.cpp's K/V views of GGML_PAD(n_ctx, 256) rows, only n_ctx written) or a padding position whose input
was zeros, through projections without a bias (LLaVA's re-padded image+text embeddings; any `nn.Embedding` row of
its `padding_idx` under a bias-free projection). Recorded per batch row as the length of the run of such keys at the
start and at the end of the keys, and the query rows that are zero too (padding queries themselves); checks/zerokv.py
says where real queries see them.

Cheap where there is nothing to find: the first dimension of each row's first and last key in every head of K and V
(one element a head; on the CPU through numpy, a few microseconds a call). Where one may be zero, the run is read
from the same side's edge of the keys the call's mask keeps (each batch row's first and last kept key; every key where
there is no mask) inward, a chunk at a time, only as far as it goes: a static cache's unwritten tail, hidden by the
mask, is not read, so the cost does not grow with the cache's length. Each run's first and last key are read whole,
in K and in V; a run whose ends are not zero is none. Each row's kept bounds are recorded ("keys") where they are
not every key; checks/zerokv.py reads the runs from them.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from maskcli.trace.hostview import host

SPANS = 64  # zero query spans kept per batch row (more: the row is left out, as unread)


def zero_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape: tuple, mask=None, is_causal: bool = False,
            edges: bool | None = None) -> dict:
    """{"zero_kv": {"left": [..], "right": [..], "zero_q": [[[start, end], ...], ...]}} per batch row (call.shape[0]
    rows, or 1 where K's batch is broadcast), or {} where no edge key is zero in K and V. `k_shape`: K's shape, read
    once by the caller. `mask` (SDPA's attn_mask) or `is_causal`: the runs are read from the edges of the keys some
    query keeps (each row's first and last kept key), and each row's [first, last + 1) is recorded as "keys" where it
    is not every key: hidden slots (a static cache's unwritten tail) are not read at all. `edges`: _edges_nonzero(k,
    k_shape) where the caller read it already (trace/keyreads.py: zerokeys.py reads it too), None to read it here."""
    if not 3 <= len(k_shape) <= 4 or k_shape[-2] < 3:
        return {}
    try:
        if not (k.dim() == v.dim() == q.dim()) or k.is_nested or v.shape[-2] != k_shape[-2]:
            return {}
        if _edges_nonzero(k, k_shape) if edges is None else edges:
            return {}  # (most calls: no row's first or last key may be zero, read cell by cell)
    except Exception:  # noqa: BLE001 - as below
        return {}
    found = _edge_runs(q, k, v, k_shape, mask, is_causal)
    try:
        return {**found, **_unwritten(k, v, k_shape, q.shape[-2])}
    except Exception:  # noqa: BLE001 - as below
        return found


def _edge_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape: tuple, mask, is_causal: bool) -> dict:
    """zero_kv past its first test (some row's first or last key may be zero)."""
    try:
        if _kept_edges_nonzero(k, v, k_shape, lambda: _bounds(mask, is_causal, q.shape[-2], k_shape[-2])):
            return {}  # (left padding the mask hides: the keys kept at each edge are not zero, read cell by cell)
        cells = _cpu(k)
        if cells is not None and _numpy_ready(v) and _numpy_ready(q):
            # (numpy: a few us an operation where torch's cost tens; V made a numpy view only where K's edge may be 0)
            return _zero_kv_cpu(q, cells, lambda: _cpu(v), lambda: _bounds(mask, is_causal, q.shape[-2], k_shape[-2]))
        if not _edge_may_be_zero(k, k_shape[-2]):
            return {}
        with torch.no_grad():
            zero = (_first(k) & _first(v)).cpu()  # (B, Lk): candidates, from each key's first dimension
            length = zero.shape[1]
            left = torch.where(zero.all(dim=1), length, (~zero).int().argmax(dim=1)).tolist()
            right = torch.where(zero.all(dim=1), length, (~zero).flip(1).int().argmax(dim=1)).tolist()
            rows = k.shape[0] if k.dim() == 4 else 1
            for b in range(len(left)):  # each run's first and last key read in every dimension: else no run
                for side, run in (("left", left[b]), ("right", right[b])):
                    ends = (0, run - 1) if side == "left" else (length - run, length - 1)
                    if run >= 2 and not all(_whole(t, b % rows if t.dim() == 4 else None, at) for t in (k, v)
                                            for at in ends):
                        (left if side == "left" else right)[b] = 0
            if max(max(left), max(right)) < 2:
                return {}
            zero_q = _first(q).cpu()  # (a real query's first dimension 0 in every head only makes the rule quieter)
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, compiled, meta, sparse) holds no padding we can see
        return {}
    return {"zero_kv": {"left": left, "right": right, "zero_q": [_spans(row) for row in zero_q]}}


def _unwritten(k: torch.Tensor, v: torch.Tensor, k_shape: tuple, q_len: int) -> dict:
    """{"unwritten": n}: the last n keys are zero in K's and V's first dimension in every batch row and head, and the
    first and last of them in every dimension, where fewer queries than keys sit before them (n <= Lk - Lq): a static
    buffer's slots past the ones written (eole's `k_cache[:, :, cache_slice] = k` into zeros), so the queries are the
    last written slots (checks/context.queries). CPU tensors only (read through numpy views: two C calls); {} else."""
    if len(k_shape) != 4 or not _numpy_ready(k) or not _numpy_ready(v) or v.dim() != 4 or q_len >= k_shape[-2]:
        return {}
    k0, v0 = _cpu(k)[..., 0], _cpu(v)[..., 0]  # (B, H, Lk) views
    if k0[..., -1].any() or v0[..., -1].any():
        return {}  # (the last key written in some row or head: most calls, left padding's among them, end here)
    written = np.logical_or.reduce((k0 != 0).reshape(-1, k0.shape[-1]), axis=0) | \
        np.logical_or.reduce((v0 != 0).reshape(-1, v0.shape[-1]), axis=0)
    if written[-1] or not written.any():
        return {}
    last = int(written.shape[0] - 1 - written[::-1].argmax())
    count = written.shape[0] - 1 - last
    if last + 1 < q_len or any(t[:, :, at].any() for t in (_cpu(k), _cpu(v)) for at in (last + 1, written.shape[0] - 1)):
        return {}
    return {"unwritten": count}


def _edges_nonzero(k: torch.Tensor, k_shape: tuple) -> bool:
    """Whether the first dimension of every row's and head's first and last key of a CPU K is nonzero, each of those
    cells read alone at its address (about a microsecond a cell, where making a numpy view and counting it costs tens
    on a traced call, its caches cold from the model's own work); False where that is not known so (more heads than
    EDGES cells, a tensor not read so: the numpy or torch path then reads them)."""
    if not 3 <= len(k_shape) <= 4 or k.dim() != len(k_shape) or k_shape[-2] < 1:
        return False  # (the addresses below are a 3-D or 4-D K's own: any other would be read past its storage)
    rows, heads = (k_shape[0], k_shape[1]) if len(k_shape) == 4 else (1, k_shape[0])
    cell = _CELLS.get(k.dtype)
    if rows * heads * 2 > EDGES or cell is None or not k.is_cpu or type(k) is not torch.Tensor or k.layout != torch.strided:
        return False
    base = k.data_ptr()
    if not base:
        return False  # (no storage to read: an empty or a zero tensor)
    strides, size, last = k.stride(), k.element_size(), k_shape[-2] - 1
    row, head, key = (strides[0], strides[1], strides[2]) if len(k_shape) == 4 else (0, strides[0], strides[1])
    at, mask = cell.from_address, 0x7FFF if cell is ctypes.c_uint16 else None  # (float16: its bits, sign left out)
    for b in range(rows):
        for h in range(heads):
            for position in (0, last):
                value = at(base + size * (b * row + h * head + position * key)).value
                if not (value & mask if mask is not None else value):
                    return False  # (0 or -0: this edge may be padding, read as before)
    return True


def _kept_edges_nonzero(k: torch.Tensor, v: torch.Tensor, k_shape: tuple, bounds) -> bool:
    """Where an edge key may be zero: whether each row's first and last key some query keeps (`bounds()`, as
    _zero_kv_cpu reads them) has a nonzero first dimension in some head of K or of V, read cell by cell (no run of zero
    keys can start there, so there is none: a left-padded batch whose padding keys are zero and masked); False where that
    is not known so (more cells than EDGES, a tensor not read so, a row whose kept edge is zero)."""
    if len(k_shape) != 4 or v.dim() != 4 or k_shape[0] * k_shape[1] * 2 > EDGES or v.shape[0] * v.shape[1] * 2 > EDGES:
        return False
    cells = [_cells(t) for t in (k, v)]
    if cells[0] is None or cells[1] is None:
        return False
    kept = bounds()
    length = k_shape[-2]
    rows = max(k_shape[0], v.shape[0], 1 if kept is None else len(kept))
    spans = [[0, length]] * rows if kept is None else kept * rows if len(kept) == 1 else kept
    for b, (lo, hi) in enumerate(spans):
        if hi <= lo:
            continue  # (no key kept: no run read there either)
        for at in (lo, hi - 1):
            if not all(a or c for a, c in zip(_nonzero(cells[0], b, at), _nonzero(cells[1], b, at))):
                return False  # (a head whose K and V are 0 there: a run may start, in that head alone)
    return True


def _cells(t: torch.Tensor) -> tuple | None:
    """(read one cell at an address, its float16 bits' mask or None, base, strides, element size, batch, heads) of a
    4-D CPU tensor read cell by cell; None where it is not read so."""
    cell = _CELLS.get(t.dtype)
    if cell is None or not t.is_cpu or type(t) is not torch.Tensor or t.layout != torch.strided:
        return None
    base = t.data_ptr()
    if not base:
        return None
    return cell.from_address, 0x7FFF if cell is ctypes.c_uint16 else None, base, t.stride(), t.element_size(), t.shape[0], t.shape[1]


def _nonzero(cells: tuple, b: int, at: int) -> list[bool]:
    """Whether key `at` of batch row `b` (modulo a broadcast batch) has a nonzero first dimension, in each head."""
    read, mask, base, strides, size, rows, heads = cells
    start = base + size * ((b % rows) * strides[0] + at * strides[2])
    values = [read(start + size * h * strides[1]).value for h in range(heads)]
    return [bool(value & mask if mask is not None else value) for value in values]


EDGES = 64  # edge cells read one by one at most (more: numpy's one count reads them)
_CELLS = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double, torch.float16: ctypes.c_uint16}


def _numpy_ready(t: torch.Tensor) -> bool:
    """Whether _cpu(t) gives t's cells (asked before making the view: most calls never need V's)."""
    return t.is_cpu and t.dtype in _NUMPY and type(t) is torch.Tensor


def _cpu(t: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor's cells as a numpy view (no copy), 4-D; None elsewhere (a GPU's, bfloat16, a subclass)."""
    if not t.is_cpu or t.dtype not in _NUMPY or type(t) is not torch.Tensor:
        return None
    cells = host(t)
    return cells if cells.ndim == 4 else cells[None]


def _bounds(mask, is_causal: bool, q_len: int, k_len: int) -> list | None:
    """R x [first, last + 1) of the keys some query of each batch row keeps (R: 1, or the mask's batch), None where
    every key may be kept (no mask, or one not read here: then every key's edge is read, as it was). A float mask hides
    a cell at or below the additive sentinel (-1e4, -inf); NaN and +inf count as kept (more read, never less)."""
    if mask is None:
        return [[0, min(q_len, k_len)]] if is_causal and q_len < k_len else None  # (top-left causal)
    if not isinstance(mask, torch.Tensor) or mask.dim() < 1 or mask.shape[-1] != k_len or not mask.is_cpu:
        return None
    version = None if mask.is_inference() else mask._version  # (an inference_mode tensor keeps no version counter)
    found = _VISIBLE.get(id(mask))
    if found is not None and version is not None and found[0]() is mask and found[1] == version:
        return found[2]  # (one mask handed to every layer of a step: read once)
    from maskcli.inspect.polarity import SENTINEL_AT_MOST

    try:
        cells = host(mask)
    except (RuntimeError, TypeError):
        return None
    if cells.dtype != bool:
        cells = ~(cells <= SENTINEL_AT_MOST)
    either = np.logical_or.reduce
    kept = either(cells.reshape(cells.shape[0], -1, k_len), axis=1) if cells.ndim == 4 \
        else either(cells.reshape(-1, k_len), axis=0)[None]  # (R, Lk)
    bounds = [[first, k_len - last] if row[first] else [0, 0]
              for row, first, last in zip(kept, kept.argmax(axis=1).tolist(), kept[:, ::-1].argmax(axis=1).tolist())]
    import weakref

    if len(_VISIBLE) > 64:
        _VISIBLE.clear()
    if version is not None:
        _VISIBLE[id(mask)] = (weakref.ref(mask), version, bounds)
    return bounds


_VISIBLE: dict = {}  # id(mask) -> (a weak reference to it, its version, its rows' bounds)
CHUNK = 16  # keys read at first past an edge whose first key may be zero (then 4x as many each time)


def _zero_kv_cpu(q: torch.Tensor, k: np.ndarray, values, bounds) -> dict:
    """zero_kv over 4-D numpy views of K and V (`values()`: V's, made only where K's edge may be zero; q: read last,
    where a run is found). First the first dimension of each row's first and last key in every head of K: where none
    may be zero, nothing more is read (most calls); then V's likewise. Where one may, `bounds()`
    (each row's kept keys, or None) is asked, and the run is read from the same side's edge of the kept keys inward, a
    chunk at a time, only as far as it goes (never the hidden keys past the edge: a static cache's unwritten tail);
    each run's two ends read whole."""
    length = k.shape[2]
    k0 = k[..., 0]  # (B, H, Lk) view
    count = np.count_nonzero
    ends = k0[:, :, :: length - 1]  # (B, H, 2)
    if count(ends) == ends.size:
        return {}  # (the common case: no head's first or last key is 0 in its first dimension; one C call)
    v = values()
    v0 = v[..., 0]
    either = np.logical_or.reduce
    edge = ~(either(ends, axis=1) | either(v0[:, :, :: length - 1], axis=1))  # (B, 2): may be zero
    if not edge.any():
        return _head_runs(q, k, v, bounds)
    kept = bounds()
    rows = max(k.shape[0], v.shape[0], 1 if kept is None else len(kept))
    spans = [[0, length]] * rows if kept is None else kept * rows if len(kept) == 1 else kept
    left, right = [0] * rows, [0] * rows
    for b, (lo, hi) in enumerate(spans):
        if hi <= lo:
            continue
        kb, vb = k0[b % k0.shape[0]], v0[b % v0.shape[0]]
        for forward, at in ((True, lo), (False, hi - 1)):
            if not edge[b % edge.shape[0], 0 if forward else 1] or count(kb[:, at]) or count(vb[:, at]):
                continue  # (a run starts where the keys start, and the first key kept is in it)
            run = _run(kb, vb, lo, hi, forward)
            at_ends = (lo, lo + run - 1) if forward else (hi - run, hi - 1)
            if run >= 2 and run < hi - lo and not all(_whole_np(t[b % t.shape[0]], at) for t in (k, v) for at in at_ends):
                run = 0
            (left if forward else right)[b] = run
    if all(max(a, c) < 2 or a >= hi - lo for a, c, (lo, hi) in zip(left, right, spans)):
        return _head_runs(q, k, v, bounds)  # (no run of two at an edge in every head, or every key zero: a head's own?)
    zero_q = ~(_cpu(q)[..., 0] != 0).any(axis=1)  # (B, Lq): a query whose first dimension is 0 in every head
    found = {"left": left, "right": right, "zero_q": [_spans_np(row) for row in zero_q]}
    if kept is not None and any(lo or hi != length for lo, hi in spans):
        found["keys"] = [list(x) for x in spans]
    return {"zero_kv": found}


def _head_runs(q: torch.Tensor, k: np.ndarray, v: np.ndarray, bounds) -> dict:
    """Runs of keys zero in K and V at an edge of some heads' keys only, where no key there is zero in every head: a
    cache that pads each head's own kept keys to the longest head's (VeloxQuant's NestedKV, its front zero-padded):
    {"zero_kv": {"left": 0s, "right": 0s, "zero_q": .., "heads": per row [[head, left, right], ...]}}, or {}."""
    length, k0, v0 = k.shape[2], k[..., 0], v[..., 0]
    if k0.shape[1] != v0.shape[1] or not ((k0[:, :, :: length - 1] == 0) & (v0[:, :, :: length - 1] == 0)).any():
        return {}
    kept = bounds()
    rows = max(k.shape[0], v.shape[0], 1 if kept is None else len(kept))
    spans = [[0, length]] * rows if kept is None else kept * rows if len(kept) == 1 else kept
    heads = []
    for b, (lo, hi) in enumerate(spans):
        found, kb, vb = [], k[b % k.shape[0]], v[b % v.shape[0]]
        for h in range(k0.shape[1]):
            runs = [0, 0]
            for side, at in ((0, lo), (1, hi - 1)):  # (another head holding a key there: zero in this head alone)
                if hi - lo > 2 and not kb[h, at, 0] and not vb[h, at, 0] and (kb[:, at, 0].any() or vb[:, at, 0].any()):
                    run = _run(kb[h:h + 1, :, 0], vb[h:h + 1, :, 0], lo, hi, side == 0)
                    ends = (lo, lo + run - 1) if side == 0 else (hi - run, hi - 1)
                    runs[side] = run if 2 <= run < hi - lo and not any(t[h, e].any() for t in (kb, vb) for e in ends) else 0
            if max(runs) >= 2:
                found.append([h, *runs])
        heads.append(found)
    if not any(heads):
        return {}
    zero_q = ~(_cpu(q)[..., 0] != 0).any(axis=1)
    return {"zero_kv": {"left": [0] * rows, "right": [0] * rows, "zero_q": [_spans_np(row) for row in zero_q],
                        "heads": heads, **({"keys": [list(x) for x in spans]} if kept is not None else {})}}


def _run(k0: np.ndarray, v0: np.ndarray, lo: int, hi: int, forward: bool) -> int:
    """How many keys from the edge of [lo, hi) (its first with `forward`, else its last) inward have a first dimension
    0 in every head of K (k0: (H, Lk)) and V, read CHUNK keys at first and four times as many each time after."""
    run, size = 0, 1  # (the edge key alone first: most calls stop there)
    while run < hi - lo:
        start, stop = (lo + run, min(hi, lo + run + size)) if forward else (max(lo, hi - run - size), hi - run)
        zero = ~((k0[:, start:stop] != 0).any(axis=0) | (v0[:, start:stop] != 0).any(axis=0))
        if not forward:
            zero = zero[::-1]
        if not zero.all():
            return run + int(zero.argmin())
        run += stop - start
        size = CHUNK if size == 1 else size * 4
    return run


def _whole_np(t: np.ndarray, at: int) -> bool:
    """Whether key `at` of one batch row's (H, Lk, E) cells is 0 in every head and dimension."""
    return not t[:, at].any()


def _spans_np(row: np.ndarray) -> list | None:
    """[[start, end), ...] of the True runs of a 1-D bool array; None past SPANS runs."""
    if not row.any():
        return []
    change = np.flatnonzero(np.diff(np.concatenate([[False], row, [False]]).astype(np.int8)))
    if change.size > 2 * SPANS:
        return None
    change = change.tolist()
    return [change[i:i + 2] for i in range(0, len(change), 2)]


def _first(t: torch.Tensor) -> torch.Tensor:
    """Bool (B, L): the rows of (B, H, L, E) or (H, L, E) (one batch row) whose first dimension is 0 in every head
    (one element a row and head read: a cache of a million slots is read once, not its every dimension)."""
    zero = t[..., 0] == 0
    return zero.all(dim=1) if t.dim() == 4 else zero.all(dim=0)[None]


def _whole(t: torch.Tensor, b: int | None, at: int) -> bool:
    """Whether key `at` of batch row `b` (None: a (H, L, E) tensor) is 0 in every head and dimension."""
    row = t[b, :, at] if b is not None else t[:, at]
    return not bool(row.any())


_NUMPY = (torch.float32, torch.float64, torch.float16)


def _edge_may_be_zero(k: torch.Tensor, length: int) -> bool:
    """Whether the first or the last key of some row and head is 0 in its first dimension (a key zero in every
    dimension is): on the CPU read through numpy (about two microseconds; torch's ops cost several each)."""
    if k.is_cpu and k.dtype in _NUMPY:
        ends = host(k)[..., :: length - 1, 0]
        return np.count_nonzero(ends) < ends.size
    with torch.no_grad():
        return bool((k[..., :: length - 1, 0] == 0).any())


def _spans(row: torch.Tensor) -> list | None:
    """[[start, end), ...] of the True runs of a 1-D bool tensor; None past SPANS runs."""
    if not bool(row.any()):
        return []
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), row.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    change = torch.nonzero(padded[1:] != padded[:-1]).flatten()
    if change.numel() > 2 * SPANS:
        return None
    change = change.tolist()
    return [change[i:i + 2] for i in range(0, len(change), 2)]
