"""The mask a FlexAttention call applies, read from its BlockMask as key intervals, never as L x L cells.

A kernel attends a cell when its block is listed full, or listed partial and the
mask_mod allows the cell; unlisted blocks are masked. So only the partial blocks' cells
are evaluated (a band of one query block by its partial key blocks at a time) and each
row's intervals are the full blocks' ranges joined with the runs the mask_mod allows:
a causal mask of 1M tokens evaluates its diagonal blocks only. (The unfused CPU path
evaluates the mask_mod on every cell; for a BlockMask made by create_block_mask the two agree.)
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.intervals import Intervals
from maskcli.tracefile import by_row
from maskcli.trace.masks import Seen, _dtype, _four, everything
from maskcli.trace.flexrows import unvisited
from maskcli.trace.queried import query_tensor
from maskcli.trace.zerokv import zero_kv

FLEX_NAMES = ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa", "return_lse", "kernel_options")


def flex(args: tuple, kwargs: dict) -> Seen:
    given = dict(zip(FLEX_NAMES, args)) | kwargs
    q, k, v = given["query"], given["key"], given["value"]
    q_len, k_len = q.shape[-2], k.shape[-2]
    block_mask = given.get("block_mask")
    score_mod = given.get("score_mod")
    details = {"score_mod": score_mod is not None, "scale": given.get("scale"), "enable_gqa": bool(given.get("enable_gqa", False))}
    details.update(zero_kv(q, k, v, tuple(k.shape)))  # keys zero in K and V at an edge (trace/zerokv.py)
    details["query_tensor"] = query_tensor(q) if q.shape[-2] > 1 else None  # (a sibling branch's queries: checks/branchrows.py)
    seen = Seen("flex", (*_four(tuple(q.shape[:-2])), q_len, k_len), tuple(q.shape), tuple(k.shape), tuple(v.shape),
                _dtype(q), str(q.device), details=details)
    if block_mask is None:
        seen.intervals = everything(q_len, k_len)
    else:
        details["mask_mod"] = getattr(block_mask.mask_mod, "__name__", type(block_mask.mask_mod).__name__)
        details["block_size"] = list(block_mask.BLOCK_SIZE)
        seen.intervals, seen.planes = block_intervals(block_mask, q_len, k_len)
        lost = unvisited(block_mask, seen.shape[0], q_len, k_len, _evaluate)  # (B=None, a mask_mod reading b: flexrows)
        if lost is not None:
            details["blocks_of_row_0"] = lost
    if score_mod is not None:
        details["score_mod_name"] = getattr(score_mod, "__name__", type(score_mod).__name__)
        found, planes, details["score_mod_read"] = score_masking(score_mod, *seen.shape, q.device)
        if found is not None:
            target = (max(planes[0], seen.planes[0]), max(planes[1], seen.planes[1]))
            seen.intervals = _spread(seen.intervals, seen.planes, target) & _spread(found, planes, target)
            seen.planes = target
        if "bias" in details["score_mod_read"]:  # (what it adds, by distance: trace/flexbias.py)
            from maskcli.trace.flexbias import score_bias

            profiled = score_bias(score_mod, seen)
            if profiled is not None:
                details["position_bias"] = profiled
    return seen


flex.api = "flex"

SCORE_BAND = 1 << 22  # cells of the score_mod's grid evaluated at once
SCORE_LIMIT = 1 << 26  # cells past which the score_mod is not evaluated (and the report says its masking was not read)


def score_masking(score_mod, batch: int, heads: int, q_len: int, k_len: int, device):
    """(intervals, (b, h), what was read) of the cells a score_mod sets to -inf, which the kernel then masks.

    The score_mod runs on the index grid a band of query rows at a time (never L x L at once), vmapped as
    create_mask vmaps it (torch/nn/attention/flex_attention.py, create_mask, lines 1735-1739 of torch 2.13), with
    two probe scores, 0 and 1: a cell at -inf for both is masked; a mask that differs between the probes depends on
    the score's value and is not read (None); values other than the probe where not masked are a bias, said."""
    cells = batch * heads * q_len * k_len
    if cells > SCORE_LIMIT:
        return None, None, f"not read: {cells:,} cells are past the {SCORE_LIMIT:,} maskcli evaluates a score_mod on"
    try:
        from torch.nn.attention.flex_attention import _vmap_for_bhqkv

        run = _vmap_for_bhqkv(score_mod, prefix=(0,))
    except ImportError:  # (another torch: called on broadcast indices, as maskcli calls a mask_mod)
        run = lambda score, b, h, m, n: score_mod(score, b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), m.view(1, 1, -1, 1), n.view(1, 1, 1, -1))  # noqa: E731
    b, h, n = (torch.arange(x, device=device) for x in (batch, heads, k_len))
    rows = max(1, SCORE_BAND // (batch * heads * k_len))
    cols = np.arange(k_len)
    runs, bias, same_b, same_h = [], False, True, True  # runs: (plane, row, start, end) of each band
    try:
        with torch.no_grad():
            for lo in range(0, q_len, rows):
                m = torch.arange(lo, min(q_len, lo + rows), device=device)
                outs = [torch.broadcast_to(run(torch.full((batch, heads, len(m), k_len), probe, device=device), b, h, m, n),
                                           (batch, heads, len(m), k_len)) for probe in (0.0, 1.0)]
                masked = torch.isneginf(outs[0])
                if not torch.equal(masked, torch.isneginf(outs[1])):
                    return None, None, "not read: which cells it sets to -inf depends on the score's value"
                bias = bias or any(bool(((out != probe) & ~masked).any()) for out, probe in zip(outs, (0.0, 1.0)))
                keep = (~masked).cpu().numpy()
                same_b = same_b and bool((keep == keep[:1]).all())
                same_h = same_h and bool((keep == keep[:, :1]).all())
                for plane, cells in enumerate(keep.reshape(batch * heads, len(m), k_len)):
                    r, s, e = _runs(cells, cols)
                    runs.append((np.full(len(r), plane), r + lo, s, e))
    except Exception as error:  # noqa: BLE001 - a score_mod maskcli cannot run on index tensors: said, not raised
        return None, None, f"not read: it could not run on index tensors ({type(error).__name__}: {str(error)[:80]})"
    planes = (1 if same_b else batch, 1 if same_h else heads)
    plane, row, start, end = (np.concatenate([part[i] for part in runs]).astype(np.int64) for i in range(4))
    pb, ph = plane // heads, plane % heads
    chosen = (pb < planes[0]) & (ph < planes[1])
    flat = (pb * planes[1] + ph)[chosen] * q_len + row[chosen]
    order = np.argsort(flat, kind="stable")
    count = planes[0] * planes[1]
    s_out, e_out = by_row(flat[order], start[chosen][order], end[chosen][order], count * q_len, k_len)
    intervals = Intervals.of(s_out.reshape(count, q_len, -1), e_out.reshape(count, q_len, -1), 0, k_len)
    return intervals, planes, "read: its -inf cells, and it adds a bias elsewhere" if bias else "read: its -inf cells"


def _spread(intervals: Intervals, planes: tuple[int, int], target: tuple[int, int]) -> Intervals:
    """Intervals of (b, h) planes repeated to the `target` planes (each 1 or the target's own)."""
    if tuple(planes) == tuple(target):
        return intervals
    def grow(x):
        return np.broadcast_to(x.reshape(planes[0], planes[1], *x.shape[1:]), (*target, *x.shape[1:])).reshape(-1, *x.shape[1:])
    return Intervals.of(grow(intervals.starts), grow(intervals.ends), intervals.k_start, intervals.k_end)


def block_intervals(block_mask, q_len: int, k_len: int) -> tuple[Intervals, tuple[int, int]]:
    """Key intervals (b*h, Lq, K) of the cells the BlockMask's kernel attends, and (b, h) as the BlockMask holds them."""
    q_block, kv_block = (int(x) for x in block_mask.BLOCK_SIZE)
    partial_n = block_mask.kv_num_blocks.cpu().numpy()
    partial_i = block_mask.kv_indices.cpu().numpy()
    full_n = block_mask.full_kv_num_blocks.cpu().numpy() if block_mask.full_kv_num_blocks is not None else None
    full_i = block_mask.full_kv_indices.cpu().numpy() if block_mask.full_kv_indices is not None else None
    planes_b, planes_h = partial_n.shape[:2]
    device = block_mask.kv_indices.device
    rows, starts, ends = [], [], []
    plane = 0
    for b in range(planes_b):
        for h in range(planes_h):
            for i in range(-(-q_len // q_block)):
                lo, hi = i * q_block, min(q_len, (i + 1) * q_block)
                offset = plane * q_len
                if full_n is not None and i < full_n.shape[2]:
                    for first, last in _ranges(full_i[b, h, i, : full_n[b, h, i]]):  # whole blocks: every row sees each
                        rows.append(np.arange(lo, hi) + offset)
                        starts.append(np.full(hi - lo, first * kv_block))
                        ends.append(np.full(hi - lo, min(k_len, last * kv_block)))
                if i >= partial_n.shape[2]:
                    continue
                blocks = np.sort(partial_i[b, h, i, : partial_n[b, h, i]])
                if len(blocks) == 0:
                    continue
                cols = np.concatenate([np.arange(j * kv_block, min(k_len, (j + 1) * kv_block)) for j in blocks.tolist()])
                if len(cols) == 0:
                    continue
                cells = _evaluate(block_mask.mask_mod, b, h, np.arange(lo, hi), cols, device)
                r, s, e = _runs(cells, cols)
                rows.append(r + lo + offset)
                starts.append(s)
                ends.append(e)
            plane += 1
    planes = planes_b * planes_h
    if not rows:
        return Intervals.of(np.full((planes, 1, 1), k_len), np.full((planes, 1, 1), k_len), 0, k_len), (planes_b, planes_h)
    row, start, end = (np.concatenate(x).astype(np.int64) for x in (rows, starts, ends))
    order = np.argsort(row, kind="stable")
    row, start, end = row[order], start[order], end[order]
    s_out, e_out = by_row(row, start, end, planes * q_len, k_len)
    width = s_out.shape[1]
    found = Intervals.of(s_out.reshape(planes, q_len, width), e_out.reshape(planes, q_len, width), 0, k_len)
    return found, (planes_b, planes_h)


def _ranges(blocks: np.ndarray) -> list[tuple[int, int]]:
    """[first, last) runs of consecutive block indices: the full blocks of a causal row are one range, not thousands."""
    j = np.sort(blocks.astype(np.int64))
    if len(j) == 0:
        return []
    breaks = np.flatnonzero(np.diff(j) != 1)
    firsts = np.concatenate([j[:1], j[breaks + 1]])
    lasts = np.concatenate([j[breaks], j[-1:]]) + 1
    return list(zip(firsts.tolist(), lasts.tolist()))


def _evaluate(mask_mod, b: int, h: int, q_rows: np.ndarray, cols: np.ndarray, device) -> np.ndarray:
    """Bool (rows, cols): the mask_mod on local indices, called once on broadcast index tensors as maskcli calls
    a mask_mod; one that cannot take them (Python control flow on values) goes through torch.vmap as create_mask does."""
    bt = torch.tensor(b, device=device)
    ht = torch.tensor(h, device=device)
    qt = torch.as_tensor(q_rows, device=device).view(-1, 1)
    kt = torch.as_tensor(cols, device=device).view(1, -1)
    with torch.no_grad():
        try:
            out = torch.as_tensor(mask_mod(bt, ht, qt, kt), device=device)
            out = torch.broadcast_to(out, (len(q_rows), len(cols)))
        except Exception:
            inner = torch.vmap(lambda q, kv: mask_mod(bt, ht, q, kv), in_dims=(None, 0))
            out = torch.vmap(inner, in_dims=(0, None))(qt.view(-1), kt.view(-1))
    return out.bool().cpu().numpy()


def _runs(cells: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, start, end) of each run of allowed cells; a run also breaks where the columns jump (between blocks)."""
    jump = np.ones(len(cols) + 1, dtype=bool)
    jump[1:-1] = np.diff(cols) != 1
    padded = np.zeros((cells.shape[0], cells.shape[1] + 2), dtype=bool)
    padded[:, 1:-1] = cells
    begins = padded[:, 1:-1] & (~padded[:, :-2] | jump[None, :-1])
    finish = padded[:, 1:-1] & (~padded[:, 2:] | jump[None, 1:])
    r, c = np.nonzero(begins)
    _, c_end = np.nonzero(finish)
    return r, cols[c], cols[c_end] + 1
