"""flash-attn's varlen and KV-cache arguments (flash_attn/flash_attn_interface.py, hopper/flash_attn_interface.py).

cu_seqlens_q (R+1): where each request's queries start; the keys per request from seqused_k
(or cache_seqlens, flash_attn_with_kvcache's name; or cu_seqlens_k's steps); block_table
(R, blocks) with page_block_size tokens per page; cache_leftpad (R): the column where a
request's keys start; window_size (left, right), -1 for none, so a window of W keys is
(W-1, 0); causal aligns the last query with the last key (bottom-right).
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.serve.batch import ServeBatch, table_rows
from maskcli.serve.fields import Fields

NAME = "flash_attn"
TITLE = "flash-attn varlen / kvcache arguments"
MARKS = ("cu_seqlens_q", "seqused_k", "cache_seqlens", "cu_seqlens_k", "block_table", "cache_leftpad", "window_size", "page_block_size")
READS = MARKS + ("causal",)


def load(f: Fields) -> ServeBatch:
    q_indptr = f.indptr("cu_seqlens_q")
    requests = len(q_indptr) - 1
    seq_lens = f.vector("seqused_k", "cache_seqlens")
    if seq_lens is None:
        cu_k = f.indptr("cu_seqlens_k", required=False)
        if cu_k is None:
            raise MaskError(f"{f.source!r} has flash-attn's cu_seqlens_q but no keys: add seqused_k, cache_seqlens or cu_seqlens_k")
        seq_lens = np.diff(cu_k)
    seq_lens = f.per_request(seq_lens, requests, "seqused_k", "cache_seqlens", "cu_seqlens_k")
    left = f.per_request(f.vector("cache_leftpad"), requests, "cache_leftpad")
    if left is not None and (left > seq_lens).any():  # refused here, in the file's own numbers, not as a negative key count
        r = int(np.argmax(left > seq_lens))
        given = f.key("seqused_k", "cache_seqlens") or "cu_seqlens_k's step"
        raise MaskError(f"{f.source!r}: cache_leftpad {int(left[r])} is past {given} {int(seq_lens[r])} for request {r}; "
                        f"the left padding is 0 to {given} (the keys run from cache_leftpad to {given})")
    keys = seq_lens - (left if left is not None else 0)  # the kernel's keys run from cache_leftpad to cache_seqlens
    names = {"queries": "cu_seqlens_q", "seq_lens": f.key("seqused_k", "cache_seqlens", "cu_seqlens_k"), "table": "block_table",
             "page_size": "page_block_size", "window": "window_size", "key_start": "cache_leftpad"}
    page_size, indptr, pages, short = 0, np.zeros(requests + 1, np.int64), np.zeros(0, np.int64), None
    if f.has("block_table"):
        page_size = f.page_size("page_block_size", "page_size")
        indptr, pages, short = table_rows(np.asarray(f.raw("block_table"), np.int64), -(-seq_lens // page_size), f"{f.source!r}: block_table")
    window, notes = None, ()
    causal = f.flag("causal", default=False)
    if f.has("window_size"):
        pair = np.asarray(f.raw("window_size")).ravel()
        if pair.size != 2:
            raise MaskError(f"{f.source!r}: window_size {pair.tolist()} is a pair (left, right), -1 for no limit")
        lo, hi = given = int(pair[0]), int(pair[1])
        if min(lo, hi) < -1:  # (-5 was read as -1, silently: flash_api.cpp reads any negative side as no limit)
            notes = (f"window_size ({lo}, {hi}): flash-attn reads any negative side as no limit (as -1)",)
            lo, hi = max(lo, -1), max(hi, -1)
        if hi not in (-1, 0) or (hi == -1 and lo >= 0 and not causal):
            raise MaskError(f"{f.source!r}: window_size {given} reaches keys after the query; serve reads windows of "
                            f"causal layers, (W-1, 0)")
        window = lo + 1 if lo >= 0 else None
        causal = causal or hi == 0  # flash-attn: causal is window_size[1] = 0
    return ServeBatch(NAME, q_indptr, keys, page_size, indptr, pages, names, key_start=left, short_table=short, causal=causal, window=window,
                      notes=notes)
