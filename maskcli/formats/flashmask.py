"""FlashMask (PaddlePaddle flashmask_attention): per key column, the query rows it hides, as startend_row_indices.

Documented rule (paddle.nn.functional.flashmask_attention, the call written for paddlepaddle 3.3.1:
python/paddle/nn/functional/flash_attention.py:1228, query, key, value, startend_row_indices, then keyword-only
causal and others, all paddle Tensors; its test reference
flashmask_to_densemask): startend_row_indices is int32 (B, H, Lk, bounds). For key column j:
  causal=True,  bounds 1: [LTS]             rows >= LTS are masked, and rows < j (causal);
  causal=True,  bounds 2: [LTS, LTE]        rows in [LTS, LTE) are masked, and rows < j;
  causal=False, bounds 2: [LTS, UTE]        rows >= LTS and rows < UTE are masked;
  causal=False, bounds 4: [LTS, LTE, UTS, UTE]  rows in [LTS, LTE) and in [UTS, UTE) are masked.
LT* lie in the lower-left triangle (rows >= j, the diagonal included), UT* in the upper-right
(rows < j). So a mask fits when each key column hides one run of rows at or below the diagonal
and one run above it; queries and keys must be the same positions (Lq = Lk). The column view
comes from the row intervals (base.transpose), O(L) for masks whose rows change by few keys.
"""

from __future__ import annotations

import numpy as np

from maskcli.formats.base import CannotHold, Export, mask_of, plain_rows, saved, scalar, transpose
from maskcli.intervals import Intervals

NAME = "flashmask"


def columns(mask) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per batch row, the (Lk, K) visible query rows (local) of every key."""
    f = mask.frame
    if (f.q_start, f.q_len) != (f.k_start, f.k_len):
        raise CannotHold(f"flashmask holds square self-attention masks (queries and keys the same positions), not {f.describe()}: use --for flash-attn or sdpa")
    starts, ends = plain_rows(mask, "flashmask")
    return [transpose(starts[b], ends[b], f.k_start, f.k_end) for b in range(mask.batch)]


def bounds(mask) -> tuple[np.ndarray, bool]:
    """startend_row_indices (B, 1, L, n) int32 and causal, the fewest bounds that hold the mask."""
    length = mask.frame.q_len
    j = np.arange(length, dtype=np.int64)[:, None]
    lower, upper = [], []
    for s, e in columns(mask):
        seen = Intervals(s[None], e[None], 0, length)
        hidden = ~seen
        low = hidden & Intervals(j[None], np.full((1, length, 1), length), 0, length)  # at or below the diagonal
        up = hidden & Intervals(np.zeros((1, length, 1), dtype=np.int64), j[None], 0, length)
        for part, where in ((low, "at or below"), (up, "above")):
            if part.per_row > 1:
                raise CannotHold(f"flashmask cannot express {mask.title}: a key column hides {part.per_row} separate runs of query rows {where} the diagonal (it holds one): use --for flex or sdpa")
        lower.append((low.starts[0, :, 0], low.ends[0, :, 0]))
        upper.append((up.starts[0, :, 0], up.ends[0, :, 0]))
    lts, lte = (np.stack([x[i] for x in lower]) for i in range(2))
    uts, ute = (np.stack([x[i] for x in upper]) for i in range(2))
    up_empty = uts >= ute
    uts, ute = np.where(up_empty, 0, uts), np.where(up_empty, 0, ute)
    causal = bool(np.array_equal(uts, np.zeros_like(uts)) and np.array_equal(ute, np.broadcast_to(j[:, 0], ute.shape)))
    lte_open = bool(np.all(lte == length))
    if causal:
        parts = [lts] if lte_open else [lts, lte]
    elif lte_open and bool(np.all(uts == 0)):
        parts = [lts, ute]
    else:
        parts = [lts, lte, uts, ute]
    return np.stack(parts, -1)[:, None].astype(np.int32), causal


def to(mask) -> Export:
    indices, causal = bounds(mask)
    names = {1: "LTS", 2: "LTS, LTE" if causal else "LTS, UTE", 4: "LTS, LTE, UTS, UTE"}[indices.shape[-1]]
    code = [
        "import paddle",
        "from paddle.nn.functional.flash_attention import flashmask_attention",
        "startend_row_indices = paddle.to_tensor(<startend_row_indices>.numpy(), dtype=\"int32\")  # a paddle tensor, on paddle's device",
        f"out = flashmask_attention(q, k, v, startend_row_indices=startend_row_indices, causal={causal})  # q, k, v: paddle tensors (B, L, H, D)",
    ]
    notes = [f"startend_row_indices (B, 1, L, {indices.shape[-1]}) = {names} per key column: the query rows it hides, [start, end)"]
    return Export(code, {"startend_row_indices": indices, "causal": np.array(causal)}, notes, device="cpu")  # read by torch, handed to paddle


def read(tensors: dict, flags: dict):
    """startend_row_indices (B, H, L, 1|2|4) and causal (file or --causal) back to row intervals."""
    what = "--from flashmask"
    indices = saved(tensors, "startend_row_indices", what)
    causal = bool(scalar(tensors, "causal", what)) if "causal" in tensors else bool(flags.get("causal"))
    from maskcli.errors import MaskError

    if indices.ndim != 4 or indices.shape[-1] not in (1, 2, 4) or (indices.shape[-1] == 4 and causal) or (indices.shape[-1] == 1 and not causal):
        raise MaskError(f"{what}: startend_row_indices must be (B, H, L, n) with n 1 or 2 (causal) or 2 or 4 (not causal); got {list(indices.shape)} with causal={causal}")
    if indices.shape[1] > 1 and not (indices == indices[:, :1]).all():
        raise MaskError(f"{what}: its {indices.shape[1]} heads differ; maskcli reads one mask for every head: save one head")
    batch, _, length, n = indices.shape
    if batch == 0 or length == 0 or indices.shape[1] == 0:
        raise MaskError(f"{what}: startend_row_indices has shape {list(indices.shape)}: it holds no rows; a mask has at least one")
    if indices.min() < 0 or indices.max() > length:
        raise MaskError(f"{what}: row indices must lie in 0..{length} (the sequence length); found {int(indices.min())}..{int(indices.max())}")
    j = np.arange(length, dtype=np.int64)
    planes = []
    for b in range(batch):
        x = indices[b, 0]
        lts = x[:, 0]
        lte = x[:, 1] if (causal and n == 2) or n == 4 else np.full(length, length)
        if causal:
            uts, ute = np.zeros(length, dtype=np.int64), j
        else:
            uts, ute = (x[:, 2], x[:, 3]) if n == 4 else (np.zeros(length, dtype=np.int64), x[:, 1])
        hidden = Intervals.of(np.stack([lts, uts], -1)[None], np.stack([lte, ute], -1)[None], 0, length)
        seen = ~hidden
        try:
            rows = transpose(seen.starts[0], seen.ends[0], 0, length)  # the columns' rows turned back into the rows' keys
        except CannotHold as why:
            raise MaskError(f"{what}: its query rows would not be few key intervals ({why}); maskcli reads such masks only as dense tensors") from None
        planes.append(Intervals(rows[0][None], rows[1][None], 0, length))
    width = max(p.per_row for p in planes)

    def pad(a):
        return np.concatenate([a, np.full(a.shape[:2] + (width - a.shape[2],), length, dtype=np.int64)], -1)

    intervals = Intervals(np.concatenate([pad(p.starts) for p in planes]), np.concatenate([pad(p.ends) for p in planes]), 0, length)
    return mask_of(intervals, length, length, batch, f"flashmask({n} bounds, causal={causal})")
