"""FlashAttention's varlen API: cu_seqlens, causal and window_size, no mask tensor.

Documented rule (flash_attn README, flash_attn_varlen_func docstring): sequences are packed
one after another and cut by cu_seqlens_q / cu_seqlens_k (int32, length N+1, starting at 0);
"If causal=True, the causal mask is aligned to the bottom right corner of the attention
matrix"; with window_size=(left, right) "query at position i will only attend to keys
between [i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]]
inclusive", -1 meaning no limit. So a Hugging Face window of W keys (self included) is
window_size=(W-1, 0), and causal=True is right = 0. A padded batch is given unpadded
(unpad_input): the padding tokens are not computed at all.
"""

from __future__ import annotations

import numpy as np

from maskcli.formats.base import Export, check_rows, mask_of, saved, scalar
from maskcli.formats.segments import band_rows, sequences
from maskcli.intervals import Intervals

NAME = "flash-attn"


def cu_seqlens(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def to(mask) -> Export:
    found = sequences(mask, "flash-attn varlen")
    window = (found.left, found.right)
    if found.cache:
        return _kvcache(mask, found)
    tensors = {"cu_seqlens_q": cu_seqlens(found.q_lens), "cu_seqlens_k": cu_seqlens(found.k_lens),
               "causal": np.array(found.causal), "window_size": np.array(window, dtype=np.int64)}  # the last two for --from
    code = [
        "from flash_attn import flash_attn_varlen_func",
        "# q: (total_q, nheads, headdim), k and v: (total_k, nheads_k, headdim), the sequences packed one after another",
        "out = flash_attn_varlen_func(",
        "    q, k, v, cu_seqlens_q=<cu_seqlens_q>, cu_seqlens_k=<cu_seqlens_k>,",
        f"    max_seqlen_q={int(found.q_lens.max())}, max_seqlen_k={int(found.k_lens.max())},",
        f"    causal={found.causal}, window_size={window},",
        ")",
    ]
    notes = [f"window_size=(left, right) counts keys beside the diagonal: a window of W keys is (W-1, 0); here {window}"]
    if not found.square:
        notes.append("causal and window are aligned to the bottom-right corner: the last query faces the last key")
    if found.dropped_rows:
        notes.append(f"{found.dropped_rows} padding query rows are left out (as unpad_input does): their outputs are not computed")
    return Export(code, tensors, notes)


def _kvcache(mask, found) -> Export:
    """Queries behind a left-padded cache, one batch row each: flash_attn_with_kvcache with cache_leftpad."""
    f = mask.frame
    window = (found.left, found.right)
    tensors = {"cache_seqlens": np.full(mask.batch, f.k_len, dtype=np.int32), "cache_leftpad": (found.k_lo - f.k_start).astype(np.int32),
               "seqlen_q": np.array(f.q_len), "causal": np.array(found.causal), "window_size": np.array(window, dtype=np.int64)}
    code = [
        "from flash_attn import flash_attn_with_kvcache",
        f"# q: (B, {f.q_len}, nheads, headdim); k_cache, v_cache: (B, {f.k_len}, nheads_k, headdim), row b's keys from cache_leftpad[b] on",
        "out = flash_attn_with_kvcache(",
        "    q, k_cache, v_cache, cache_seqlens=<cache_seqlens>, cache_leftpad=<cache_leftpad>,",
        f"    causal={found.causal}, window_size={window},",
        ")",
    ]
    notes = [f"window_size=(left, right) counts keys beside the diagonal: a window of W keys is (W-1, 0); here {window}",
             "cache_leftpad: the left padding of each row's cache; causal and window align the last query with key cache_seqlens - 1"]
    return Export(code, tensors, notes)


def read(tensors: dict, flags: dict):
    """cu_seqlens_q/_k (or cu_seqlens), causal and window_size from the file or the flags: a packed mask."""
    what = "--from flash-attn"
    if "cache_seqlens" in tensors:
        return _read_kvcache(tensors, flags)
    one = saved(tensors, "cu_seqlens", what, required=False)
    cq = saved(tensors, "cu_seqlens_q", what, required=one is None)
    cq = one if cq is None else cq
    ck = saved(tensors, "cu_seqlens_k", what, required=False)
    ck = cq if ck is None else ck
    for name, c in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
        if c.ndim != 1 or c.size < 2 or c[0] != 0 or (np.diff(c) < 0).any():
            raise _bad(f"{name} must be 0 then rising totals, like [0, 3, 8]; got {c.ravel()[:8].tolist()} (shape {list(c.shape)})")
        if c[-1] < 1:
            raise _bad(f"{name} {c[:8].tolist()} ends at 0: the sequences hold no tokens; a mask has at least one query and one key")
    if cq.size != ck.size:
        raise _bad(f"cu_seqlens_q has {cq.size - 1} sequences and cu_seqlens_k {ck.size - 1}: give one length per sequence in each")
    check_rows(int(cq[-1]), what)
    causal, window = _band(tensors, flags)
    left, right = window
    right = 0 if causal else right
    s, e = band_rows(np.diff(cq), np.diff(ck), left, right)
    total_q, total_k = int(cq[-1]), int(ck[-1])
    intervals = Intervals.of(s[None, :, None], e[None, :, None], 0, total_k)
    name = f"flash-attn({cq.size - 1} sequences, causal={causal}, window_size=({left}, {right}))"
    return mask_of(intervals, total_q, total_k, 1, name)


def _read_kvcache(tensors: dict, flags: dict):
    """cache_seqlens, cache_leftpad and seqlen_q: one row of queries per batch row, at the end of its cache."""
    what = "--from flash-attn"
    seqlens = saved(tensors, "cache_seqlens", what)
    leftpad = saved(tensors, "cache_leftpad", what, required=False)
    leftpad = np.zeros_like(seqlens) if leftpad is None else leftpad
    q_len = scalar(tensors, "seqlen_q", what)
    if q_len is None:
        raise _bad("a cache_seqlens file needs seqlen_q, the number of queries per batch row")
    if seqlens.ndim != 1 or leftpad.shape != seqlens.shape or (leftpad < 0).any() or (leftpad > seqlens).any():
        raise _bad(f"cache_seqlens and cache_leftpad must be one number per batch row with 0 <= leftpad <= seqlens; got {seqlens.tolist()[:8]} and {leftpad.tolist()[:8]}")
    if q_len < 1:
        raise _bad(f"seqlen_q must be 1 or more, got {q_len}")
    if seqlens.size == 0 or seqlens.max() < 1:
        raise _bad(f"cache_seqlens {seqlens.tolist()[:8]} holds no key in any batch row; a mask has at least one: give each row's cache length")
    check_rows(seqlens.size * q_len, what)
    causal, (left, right) = _band(tensors, flags)
    right = 0 if causal else right
    batch, k_len = seqlens.size, int(seqlens.max())
    s, e = band_rows(np.full(batch, q_len), seqlens - leftpad, left, right, leftpad)
    intervals = Intervals.of(s.reshape(batch, q_len, 1), e.reshape(batch, q_len, 1), 0, k_len)
    name = f"flash-attn kvcache({batch} rows, causal={causal}, window_size=({left}, {right}))"
    return mask_of(intervals, q_len, k_len, batch, name)


def _band(tensors: dict, flags: dict) -> tuple[bool, tuple[int, int]]:
    causal = bool(scalar(tensors, "causal", "--from flash-attn")) if "causal" in tensors else None
    if flags.get("causal"):
        causal = True
    window = tuple(int(v) for v in saved(tensors, "window_size", "--from flash-attn", index=False).ravel()) if "window_size" in tensors else None
    if flags.get("window") is not None:
        w = flags["window"]
        given = (w - 1, 0 if causal else -1)
        if window is not None and window[0] != given[0]:
            raise _bad(f"--window {w} is window_size ({w - 1}, ...) but the file says window_size={window}: drop --window")
        window = given
    if window is None:
        window = (-1, -1)
    if len(window) != 2 or min(window) < -1:
        raise _bad(f"window_size must be two numbers, each -1 (no limit) or 0 and more; got {window}")
    return bool(causal), window


def _bad(text: str):
    from maskcli.errors import MaskError

    return MaskError(f"--from flash-attn: {text}")
