"""MagiAttention: the mask as slices, each a query range, a key range and a mask type.

Documented rule (MagiAttention's flex_flash_attn_func, the kernel its distributed API calls,
and AttnMaskType; the call is written for MagiAttention 1.1.1, magi_attention/functional/flex_flash_attn.py:1059:
q, k, v, q_ranges, k_ranges, attn_type_map, then keyword-only options, returning (out, AttnForwardMeta) whose .lse
is the log-sum-exp; 1.0.4 and 1.0.5 take the same arguments and return (out, lse); 1.0.3 and earlier require
max_seqlen_q and max_seqlen_k, which 1.0.4 dropped and 1.1.0 brought back only max_seqlen_q, optional):
q_ranges and k_ranges are (N, 2) int32 [start, end) ranges of the packed query and key tokens; attn_type_map (N,)
is 0 FULL, 1 CAUSAL, 2 INVCAUSAL, 3 BICAUSAL. Inside a slice of lq queries and lk keys
(local i, j): FULL keeps all; CAUSAL keeps j <= i + lk - lq (bottom-right aligned);
INVCAUSAL keeps j >= i (top-left aligned); BICAUSAL keeps both. The mask is the union of
the slices. Batch rows are packed one after another (total_seqlen_q = B * Lq).
Slices are read off the rows: a run of consecutive rows whose key interval moves the same
way each row (start and end each still or one step on) is one slice.
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.formats.base import Export, check_rows, mask_of, plain_rows, rows_of, saved, scalar

NAME = "magi"
FULL, CAUSAL, INVCAUSAL, BICAUSAL = 0, 1, 2, 3


def slices(mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q_ranges (N, 2), k_ranges (N, 2), attn_type_map (N,), local packed positions, O(B x Lq x K)."""
    f = mask.frame
    starts, ends = plain_rows(mask, "magi")
    batch, q_len, k = starts.shape
    s = np.moveaxis(starts - f.k_start, 2, 1).reshape(-1, q_len)  # one line of rows per (batch row, interval column)
    e = np.moveaxis(ends - f.k_start, 2, 1).reshape(-1, q_len)
    line_batch = np.repeat(np.arange(batch), k)
    real = s < e
    ds = np.zeros_like(s)
    de = np.zeros_like(e)
    ds[:, 1:], de[:, 1:] = s[:, 1:] - s[:, :-1], e[:, 1:] - e[:, :-1]
    step_ok = np.zeros_like(real)
    step_ok[:, 1:] = real[:, 1:] & real[:, :-1] & np.isin(ds[:, 1:], (0, 1)) & np.isin(de[:, 1:], (0, 1))
    step = np.where(step_ok, ds * 2 + de, -1)
    previous = np.full_like(step, -1)
    previous[:, 1:] = step[:, :-1]
    # a row starts a slice unless it steps as the row before it stepped (the steps inside a slice are one kind)
    begins = real & (~step_ok | ((previous >= 0) & (previous != step)))
    continues = np.zeros_like(real)
    continues[:, :-1] = real[:, 1:] & ~begins[:, 1:]
    line, row = np.nonzero(begins)  # row-major: the n-th begin and the n-th last row are one slice
    _, last_row = np.nonzero(real & ~continues)
    inner = np.where(last_row > row, step[line, np.minimum(row + 1, q_len - 1)], 0)
    kind = np.array([FULL, CAUSAL, INVCAUSAL, BICAUSAL])[np.where(last_row > row, inner, 0)]
    k_lo = s[line, row]
    k_hi = np.where((kind == CAUSAL) | (kind == BICAUSAL), e[line, last_row], e[line, row])
    base_q = line_batch[line] * q_len
    q_ranges = np.stack([row + base_q, last_row + 1 + base_q], -1)
    k_ranges = np.stack([k_lo, k_hi], -1) + line_batch[line][:, None] * f.k_len
    return q_ranges.astype(np.int32), k_ranges.astype(np.int32), kind.astype(np.int32)


def to(mask) -> Export:
    q_ranges, k_ranges, types = slices(mask)
    f = mask.frame
    code = [
        "from magi_attention.functional import flex_flash_attn_func",
        "out, meta = flex_flash_attn_func(q, k, v, q_ranges=<q_ranges>, k_ranges=<k_ranges>, attn_type_map=<attn_type_map>)"
        f"  # q: ({mask.batch * f.q_len}, H, D), k and v: ({mask.batch * f.k_len}, H, D)",
    ]
    notes = [f"{len(types)} slices; attn_type_map 0 full, 1 causal (bottom-right aligned), 2 inv-causal (top-left), 3 bi-causal"]
    tensors = {"q_ranges": q_ranges, "k_ranges": k_ranges, "attn_type_map": types,
               "total_seqlen_q": np.array(mask.batch * f.q_len), "total_seqlen_k": np.array(mask.batch * f.k_len)}
    return Export(code, tensors, notes)


def keys_of(q_ranges, k_ranges, types) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, start, end) per query row of every slice, by the documented rule (O(sum of slice rows))."""
    lq = q_ranges[:, 1] - q_ranges[:, 0]
    lk = k_ranges[:, 1] - k_ranges[:, 0]
    which = np.repeat(np.arange(len(types)), np.maximum(lq, 0))
    i = np.arange(which.size) - np.repeat(np.cumsum(np.maximum(lq, 0)) - np.maximum(lq, 0), np.maximum(lq, 0))
    t = types[which]
    lo = np.where((t == INVCAUSAL) | (t == BICAUSAL), i, 0)
    hi = np.where((t == CAUSAL) | (t == BICAUSAL), np.minimum(lk[which], i + (lk - lq)[which] + 1), lk[which])
    return q_ranges[which, 0] + i, k_ranges[which, 0] + np.maximum(lo, 0), k_ranges[which, 0] + np.maximum(hi, 0)


def read(tensors: dict, flags: dict):
    """q_ranges, k_ranges, attn_type_map (and total_seqlen_q/_k, else the largest range end): one packed row."""
    what = "--from magi"
    q_ranges, k_ranges, types = (saved(tensors, name, what) for name in ("q_ranges", "k_ranges", "attn_type_map"))
    n = types.size
    if q_ranges.shape != (n, 2) or k_ranges.shape != (n, 2) or types.ndim != 1:
        raise MaskError(f"{what}: q_ranges and k_ranges must be (N, 2) and attn_type_map (N,); got {list(q_ranges.shape)}, {list(k_ranges.shape)}, {list(types.shape)}")
    if n and (not np.isin(types, (0, 1, 2, 3)).all() or (q_ranges[:, 1] < q_ranges[:, 0]).any() or (k_ranges[:, 1] < k_ranges[:, 0]).any() or q_ranges.min() < 0 or k_ranges.min() < 0):
        raise MaskError(f"{what}: ranges must be [start, end) with 0 <= start <= end, and attn_type_map 0, 1, 2 or 3")
    total = [scalar(tensors, name, what) for name in ("total_seqlen_q", "total_seqlen_k")]
    q_len = total[0] if total[0] is not None else int(q_ranges[:, 1].max(initial=0))
    k_len = total[1] if total[1] is not None else int(k_ranges[:, 1].max(initial=0))
    if q_len < 1 or k_len < 1:
        raise MaskError(f"{what}: the file holds {n} slices over {q_len} queries and {k_len} keys; a mask has at least one "
                        f"of each (give total_seqlen_q and total_seqlen_k where no slice reaches the end)")
    if n and (q_ranges[:, 1].max() > q_len or k_ranges[:, 1].max() > k_len):
        raise MaskError(f"{what}: a range ends past total_seqlen_q {q_len} or total_seqlen_k {k_len}")
    check_rows(max(q_len, int((q_ranges[:, 1] - q_ranges[:, 0]).sum())), what)
    intervals = rows_of([keys_of(q_ranges, k_ranges, types)], q_len, 0, k_len)
    return mask_of(intervals, q_len, k_len, 1, f"magi({n} slices)")
