"""The mask a FlashAttention call applies, read from its arguments as key intervals (never L x L cells).

flash_attn's functions take no mask tensor: `causal`, `window_size=(left, right)` and the
sequence lengths say it, as flash_attn_interface.py documents them. Queries are aligned to
the bottom right of each sequence: query i of Lq sits at key i + Lk - Lq, so `causal` lets
it see keys up to there and a window keys [i + Lk - Lq - left, i + Lk - Lq + right]
(-1: no bound on that side; causal sets right to 0; a bound of at least the key length is
none, as the kernel reads it). A row with no key in range gives 0 output.

Layouts: the batched functions apply one mask to every batch row, (B, H, Lq, Lk);
the varlen ones pack sequences along one axis (`cu_seqlens_q/k`, and `seqused_q/k` where a
sequence uses fewer than its slot), so their mask is one (1, H, total_q, total_k) plane with
each sequence a block of its own on the diagonal, which reads as a document mask;
flash_attn_with_kvcache sees per batch row the keys [cache_leftpad, cache_seqlens + new keys)
of its cache row. softcap and alibi_slopes change the scores, not the mask: they are details.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from maskcli.errors import MaskError
from maskcli.intervals import Intervals
from maskcli.tracefile import by_row
from maskcli.trace.masks import Seen, _dtype

FUNCTIONS = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
             "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache")
MODULES = ("flash_attn", "flash_attn_interface")  # flash_attn (2; its submodules) and FlashAttention 3's own module
SHORT = 64  # index tensors up to this many values are kept in a call's details as lists


def watched(name: str) -> bool:
    return name in MODULES or name.startswith("flash_attn.")


def short(value):
    """A tensor of lengths or ids as a list where short, else its size in words (details stay small and plain)."""
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= SHORT else f"{value.numel()} values"
    return value


def aligned(nq: np.ndarray, nk: np.ndarray, causal: bool, left: int, right: int):
    """(sequence, row, lo, hi) of every query row of sequences of nq queries and nk keys: row `row` of sequence
    `sequence` sees its sequence's keys [lo, hi), its queries aligned bottom-right (row i sits at key i + nk - nq)."""
    nq, nk = np.asarray(nq, np.int64), np.asarray(nk, np.int64)
    sequence = np.repeat(np.arange(len(nq)), nq)
    row = np.arange(len(sequence)) - np.repeat(np.cumsum(nq) - nq, nq)
    n = nk[sequence]
    at = row + n - nq[sequence]
    right = 0 if causal else right
    lo = np.zeros_like(at) if left < 0 else at - left
    hi = n if right < 0 else at + right + 1
    lo = np.clip(lo, 0, n)
    return sequence, row, lo, np.clip(hi, lo, n)


def window(given: dict, k_len: int) -> tuple[int, int]:
    """(left, right) from window_size (or window_size_left/right), -1 for none, a bound of k_len or more read as none."""
    size = given.get("window_size")
    left, right = size if size is not None else (given.get("window_size_left"), given.get("window_size_right"))
    left, right = (-1 if left is None else int(left)), (-1 if right is None else int(right))  # None: FlashAttention 4's none
    return (-1 if left >= k_len else left), (-1 if right >= k_len else right)


def rows_intervals(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, planes: int, q_len: int, k_len: int) -> Intervals:
    """(planes, Lq, 1) intervals from one [lo, hi) per listed row (`rows` over planes * Lq, ascending); the rows not
    listed see no key."""
    starts, ends = by_row(rows, lo, hi, planes * q_len, k_len)
    width = starts.shape[1]  # (named: -1 cannot be read from no row, as over 0 tokens)
    return Intervals.of(starts.reshape(planes, q_len, width), ends.reshape(planes, q_len, width), 0, k_len)


def _lengths(cu: torch.Tensor, used) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of each packed sequence: its slot in cu_seqlens, or the first seqused of it."""
    cu = cu.detach().cpu().numpy().astype(np.int64)
    lengths = np.diff(cu) if used is None else used.detach().cpu().numpy().astype(np.int64).reshape(-1)
    return cu[:-1], lengths


def read(name: str, given: dict) -> Seen:
    """The Seen of one call of flash_attn's function `name`, given its arguments by name (as that function binds them)."""
    if given.get("attention_chunk"):
        raise MaskError(f"attention_chunk={given['attention_chunk']} is not read by maskcli")
    varlen = given.get("cu_seqlens") is not None or (given.get("cu_seqlens_q") is not None and name != "flash_attn_with_kvcache")
    if name == "flash_attn_with_kvcache" and given.get("cu_seqlens_q") is not None:
        raise MaskError("flash_attn_with_kvcache with cu_seqlens_q (packed queries) is not read by maskcli")
    if "qkv" in given:
        q = k = v = given["qkv"]
        q_shape, heads = tuple(q.shape), q.shape[-2]
        k_shape = v_shape = q_shape
    else:
        q = given["q"]
        k = given.get("k_cache", given.get("kv", given.get("k")))
        v = given.get("v_cache", given.get("kv", given.get("v")))
        q_shape, k_shape, v_shape, heads = tuple(q.shape), tuple(k.shape), tuple(v.shape), q.shape[-2]
    causal = bool(given.get("causal", False))
    details = {"function": name, "causal": causal, "softmax_scale": given.get("softmax_scale"),
               "dropout_p": float(given.get("dropout_p", 0.0) or 0.0)}
    if given.get("softcap"):
        details["softcap"] = float(given["softcap"])
    if given.get("alibi_slopes") is not None:
        details["alibi_slopes"] = list(given["alibi_slopes"].shape)
    if varlen:
        cu_q = given.get("cu_seqlens", given.get("cu_seqlens_q"))
        cu_k = given.get("cu_seqlens", given.get("cu_seqlens_k"))
        q_off, nq = _lengths(cu_q, given.get("seqused_q"))
        k_off, nk = _lengths(cu_k, given.get("seqused_k"))
        q_len = q.shape[0]
        paged = given.get("block_table", given.get("page_table")) is not None
        k_len = int(cu_k[-1]) if paged else k.shape[0]  # a paged cache's keys: their logical places
        max_k = given.get("max_seqlen", given.get("max_seqlen_k"))
        left, right = window(given, int(max_k) if max_k is not None else int(nk.max(initial=0)))
        sequence, row, lo, hi = aligned(nq, nk, causal, left, right)
        rows = q_off[sequence] + row
        intervals = rows_intervals(rows, lo + k_off[sequence], hi + k_off[sequence], 1, q_len, k_len)
        details.update(window_size=[left, right], cu_seqlens_q=short(cu_q), cu_seqlens_k=short(cu_k))
        for extra in ("seqused_q", "seqused_k"):
            if given.get(extra) is not None:
                details[extra] = short(given[extra])
        seen = Seen("flash", (1, heads, q_len, k_len), q_shape, k_shape, v_shape, _dtype(q), str(q.device), details=details)
        seen.intervals = intervals
        return seen
    batch, q_len = q.shape[0], q.shape[1]
    if name != "flash_attn_with_kvcache":
        k_len = k.shape[1]
        left, right = window(given, k_len)
        _, _, lo, hi = aligned([q_len], [k_len], causal, left, right)
        planes, rows = 1, np.arange(q_len)
    else:
        k_len, lo, hi, planes, rows = _kvcache(given, details, batch, q_len, k)
        left, right = details["window_size"]
    details["window_size"] = [left, right]
    seen = Seen("flash", (batch, heads, q_len, k_len), q_shape, k_shape, v_shape, _dtype(q), str(q.device), details=details)
    seen.intervals = rows_intervals(rows, lo, hi, planes, q_len, k_len)
    seen.planes = (planes, 1)
    return seen


def _kvcache(given: dict, details: dict, batch: int, q_len: int, k_cache: torch.Tensor):
    """flash_attn_with_kvcache: per batch row, keys [leftpad, cache_seqlens + new keys) of its cache row (logical
    positions where a block table pages the cache), the queries at the end of them."""
    table = given.get("block_table", given.get("page_table"))
    slots = table.shape[1] * k_cache.shape[1] if table is not None else k_cache.shape[1]
    new = given["k"].shape[1] if given.get("k") is not None else 0
    lengths = given.get("cache_seqlens")
    if lengths is None:
        seqlen_k = np.full(batch, slots, np.int64)
    elif isinstance(lengths, int):
        seqlen_k = np.full(batch, lengths + new, np.int64)
    else:
        seqlen_k = lengths.detach().cpu().numpy().astype(np.int64).reshape(-1) + new
        details["cache_seqlens"] = short(lengths)
    pad = given.get("cache_leftpad")
    leftpad = np.zeros(batch, np.int64) if pad is None else pad.detach().cpu().numpy().astype(np.int64).reshape(-1)
    if pad is not None:
        details["cache_leftpad"] = short(pad)
    if given.get("cache_batch_idx") is not None:
        details["cache_batch_idx"] = short(given["cache_batch_idx"])
    if table is not None:
        details["block_table"] = list(table.shape)
    details["new_keys"] = new
    left, right = window(given, slots)
    sequence, row, lo, hi = aligned(np.full(batch, q_len), seqlen_k - leftpad, bool(given.get("causal")), left, right)
    details["window_size"] = [left, right]
    return slots, lo + leftpad[sequence], hi + leftpad[sequence], batch, sequence * q_len + row


def _bound(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    given = dict(bound.arguments)
    for key, value in list(given.items()):  # **kwargs of the function (a version's extra options) read by name
        if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            given.update(given.pop(key))
    return given


def reader(name: str, signature: inspect.Signature):
    """The reader for `name` (what capture calls with a call's args and kwargs)."""

    def read_call(args, kwargs):
        return read(name, _bound(signature, args, kwargs))

    read_call.api = "flash"
    return read_call


def patch(trace, module) -> None:
    """Swap flash_attn's FUNCTIONS in `module` for shims that record each call first (trace.patch.swap)."""
    import types

    from maskcli.trace.patch import swap

    for name in FUNCTIONS:
        function = getattr(module, name, None)
        if not isinstance(function, types.FunctionType) or id(function) in trace._swapped:
            continue  # (flash_attn re-exports its interface module's functions: each is swapped once)
        trace.patched.add("flash")
        read = reader(name, inspect.signature(function))
        undo = swap(function, lambda original, read=read: trace._hook(read, original))
        if undo is not None:
            trace._swapped.add(id(function))
            trace._undo.append(undo)
