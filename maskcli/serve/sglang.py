"""SGLang's ForwardBatch (python/sglang/srt/model_executor/forward_batch_info.py), as its attention backends read it.

seq_lens (R): prefix plus new tokens; extend_prefix_lens / extend_seq_lens (R): cached and new
tokens of an extend (prefill) batch (a decode batch has neither: one new token each);
req_to_token: the ReqToTokenPool's rows, the KV slot of each position of a request (the pool
itself with req_pool_indices, or one row per request); out_cache_loc (N): the slot each new
token is written to; slot 0 is the pool's padding slot (TokenToKVPoolAllocator hands out slots
from 1). page_size (1 unless the server ran with --page-size); sliding_window_size is
FlashInfer's window_left (the model's window minus 1). A verify step's custom_mask (flattened
per request (new, seq_len) bool) with mask_indptr.
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.serve.batch import ServeBatch, cumulative, table_rows
from maskcli.serve.fields import Fields

NAME = "sglang"
TITLE = "SGLang ForwardBatch"
MARKS = ("extend_prefix_lens", "extend_seq_lens", "req_to_token", "req_pool_indices", "out_cache_loc", "sliding_window_size")
READS = MARKS + ("seq_lens", "page_size", "custom_mask", "mask_indptr", "positions")
PADDING_SLOT = 0


def load(f: Fields) -> ServeBatch:
    seq_lens = f.vector("seq_lens", required=True)
    requests = len(seq_lens)
    new = f.per_request(f.vector("extend_seq_lens"), requests, "extend_seq_lens")
    prefix = f.per_request(f.vector("extend_prefix_lens"), requests, "extend_prefix_lens")
    notes = ()
    if new is None:
        new = np.ones(requests, np.int64)
        notes = ("no extend_seq_lens: read as a decode batch, one new token per request",)
    names = {"queries": "extend_seq_lens", "seq_lens": "seq_lens", "computed": "extend_prefix_lens", "table": "req_to_token",
             "writes": "out_cache_loc", "page_size": "page_size", "window": "sliding_window_size"}
    page_size = f.scalar("page_size", default=1)
    indptr, pages, short = np.zeros(requests + 1, np.int64), np.zeros(0, np.int64), None
    rows = f.raw("req_to_token")
    if rows is not None:
        rows = np.asarray(rows, np.int64)
        pool = f.vector("req_pool_indices")
        if pool is not None:
            if pool.size < requests or (pool.size and (pool.min() < 0 or pool.max() >= rows.shape[0])):
                raise MaskError(f"{f.source!r}: req_pool_indices {pool[:8].tolist()} must name one req_to_token row per request "
                                f"(0 to {rows.shape[0] - 1})")
            rows = rows[pool[:requests]]
        elif rows.ndim == 2 and rows.shape[0] != requests:
            raise MaskError(f"{f.source!r}: req_to_token has {rows.shape[0]} rows for {requests} requests: save the pool with "
                            f"req_pool_indices, or only the requests' rows (req_to_token[req_pool_indices])")
        blocks = -(-seq_lens // page_size)
        firsts = rows[:, ::page_size] if rows.ndim == 2 else rows
        indptr, slots, short = table_rows(firsts, blocks, "req_to_token")
        pages = slots // page_size  # the slot of a page's first token, as a page
    window = f.scalar("sliding_window_size")
    trees = {}
    if f.has("custom_mask"):
        trees = _trees(f, new, seq_lens)
    return ServeBatch(
        NAME, cumulative(new), seq_lens, page_size, indptr, pages, names, computed=prefix, short_table=short,
        null_page=PADDING_SLOT // page_size, write_slots=f.vector("out_cache_loc"), tokens=None if not f.has("out_cache_loc") else f.vector("out_cache_loc").size,
        window=None if window is None or window < 0 else window + 1, trees=trees, positions=f.positions(), notes=notes,
    )


def _trees(f: Fields, new: np.ndarray, seq_lens: np.ndarray) -> dict[int, np.ndarray]:
    flat = np.asarray(f.raw("custom_mask")).ravel().astype(bool)
    sizes = new * seq_lens
    indptr = f.indptr("mask_indptr", required=False)
    indptr = cumulative(sizes) if indptr is None else indptr
    if indptr[-1] > flat.size or len(indptr) != len(new) + 1:
        raise MaskError(f"{f.source!r}: custom_mask holds {flat.size} cells; the requests' (new x seq_len) masks need {int(sizes.sum())}")
    return {r: flat[indptr[r]:indptr[r] + sizes[r]].reshape(new[r], seq_lens[r]) for r in range(len(new)) if sizes[r]}
