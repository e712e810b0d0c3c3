"""SGLang's ForwardBatch (python/sglang/srt/model_executor/forward_batch_info.py), as its attention backends read it.

seq_lens (R): prefix plus new tokens; extend_prefix_lens / extend_seq_lens (R): cached and new
tokens of an extend (prefill) batch (a decode batch has neither: one new token each);
req_to_token: the ReqToTokenPool's rows, the KV slot of each position of a request (the pool
itself with req_pool_indices, or one row per request); out_cache_loc (N): the slot each new
token is written to; slot 0 is the pool's padding slot (TokenToKVPoolAllocator hands out slots
from 1). page_size (1 unless the server ran with --page-size); sliding_window_size is
FlashInfer's window_left (the model's window minus 1). A target-verify step (EAGLE) is the
batch with a custom_mask: there seq_lens exclude the drafts (speculative/eagle_utils.py
build_tree_kernel_efficient: "seq_lens: sequence length without draft tokens"), each request
verifies draft_token_num drafts, and its mask is flattened (drafts, seq_len + drafts) bool,
mask_indptr = cumsum(drafts * (seq_lens + drafts)) (the attention backends' seq_mask_len);
extend_prefix_lens / extend_seq_lens are not the verify step's and are not read there.
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.serve.batch import ServeBatch, cumulative, table_rows
from maskcli.serve.fields import Fields, checked_page_size

NAME = "sglang"
TITLE = "SGLang ForwardBatch"
MARKS = ("extend_prefix_lens", "extend_seq_lens", "req_to_token", "req_pool_indices", "out_cache_loc", "sliding_window_size")
READS = MARKS + ("seq_lens", "page_size", "custom_mask", "mask_indptr", "draft_token_num", "positions")
PADDING_SLOT = 0


def load(f: Fields) -> ServeBatch:
    seq_lens = f.vector("seq_lens", required=True)
    requests = len(seq_lens)
    notes, trees, verify = (), {}, f.has("custom_mask")
    if verify:  # a target-verify step: seq_lens are the cached tokens, the drafts come after them
        prefix = seq_lens
        new = _drafts(f, prefix)
        seq_lens = prefix + new
        trees = _trees(f, new, seq_lens)
        if f.has("extend_seq_lens", "extend_prefix_lens"):
            notes = ("a verify step (custom_mask): extend_seq_lens / extend_prefix_lens are not its lengths and were not read",)
    else:
        new = f.per_request(f.vector("extend_seq_lens"), requests, "extend_seq_lens")
        prefix = f.per_request(f.vector("extend_prefix_lens"), requests, "extend_prefix_lens")
        if new is None:
            new = np.ones(requests, np.int64)
            notes = ("no extend_seq_lens: read as a decode batch, one new token per request",)
    names = {"queries": "extend_seq_lens", "seq_lens": "seq_lens", "computed": "extend_prefix_lens", "table": "req_to_token",
             "writes": "out_cache_loc", "page_size": "page_size", "window": "sliding_window_size"}
    if verify:
        names |= {"queries": "draft_token_num", "seq_lens": "seq_lens + draft_token_num", "computed": "seq_lens"}
    page_size = checked_page_size(f.scalar("page_size", default=1), f"{f.source!r}: page_size")
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
        indptr, slots, short = table_rows(firsts, blocks, f"{f.source!r}: req_to_token")
        pages = slots // page_size  # the slot of a page's first token, as a page
    window, said = f.limit("sliding_window_size")
    notes += said
    return ServeBatch(
        NAME, cumulative(new), seq_lens, page_size, indptr, pages, names, computed=prefix, short_table=short,
        null_page=PADDING_SLOT // page_size, write_slots=f.vector("out_cache_loc"), tokens=None if not f.has("out_cache_loc") else f.vector("out_cache_loc").size,
        window=None if window is None or window < 0 else window + 1, trees=trees, positions=f.positions(), notes=notes,
    )


def _drafts(f: Fields, prefix: np.ndarray) -> np.ndarray:
    """Each request's drafts: draft_token_num, or solved from its mask's size n * (seq_len + n) (mask_indptr's steps,
    or the whole mask where every request has as many)."""
    requests = len(prefix)
    given = f.scalar("draft_token_num")
    if given is not None:
        if given < 1:
            raise MaskError(f"{f.source!r}: draft_token_num {given} must be at least 1 (the draft tokens each request verifies)")
        return np.full(requests, given, np.int64)
    indptr = f.indptr("mask_indptr", required=False)
    sizes = np.diff(indptr) if indptr is not None else None
    if sizes is None:
        total = np.asarray(f.raw("custom_mask")).size
        if requests == 0:
            return np.zeros(0, np.int64)
        # requests * n^2 + sum(seq_lens) * n = total
        s, r = int(prefix.sum()), requests
        n = (-s + np.sqrt(float(s) ** 2 + 4.0 * r * total)) / (2 * r)
        drafts = np.full(requests, int(round(n)), np.int64)
        if r * drafts[0] ** 2 + s * drafts[0] != total:
            raise MaskError(f"{f.source!r}: custom_mask holds {total} cells, which is no number of drafts n per request "
                            f"with n x (seq_len + n) cells each: add draft_token_num (or mask_indptr)")
        return drafts
    if len(sizes) != requests:
        raise MaskError(f"{f.source!r}: mask_indptr has {len(sizes) + 1} entries for {requests} requests: give requests + 1")
    drafts = np.round((-prefix + np.sqrt(prefix.astype(float) ** 2 + 4.0 * sizes)) / 2).astype(np.int64)
    off = np.flatnonzero(drafts * (prefix + drafts) != sizes)
    if off.size:
        r = int(off[0])
        raise MaskError(f"{f.source!r}: request {r}'s custom_mask holds {int(sizes[r])} cells (mask_indptr), which is no n x "
                        f"(seq_len {int(prefix[r])} + n) for n drafts: add draft_token_num")
    return drafts


def _trees(f: Fields, new: np.ndarray, seq_lens: np.ndarray) -> dict[int, np.ndarray]:
    flat = np.asarray(f.raw("custom_mask")).ravel().astype(bool)
    needed = float(np.sum(new.astype(float) * seq_lens))  # in floats first: new x seq_len may pass int64
    indptr = f.indptr("mask_indptr", required=False)
    fits = needed <= flat.size and (indptr is None or len(indptr) == len(new) + 1)
    sizes = new * seq_lens if fits else None
    indptr = cumulative(sizes) if indptr is None and fits else indptr
    if not fits or (indptr[:-1] + sizes).max(initial=0) > flat.size:
        given = f.scalar("draft_token_num")
        if given is not None:  # the count the user wrote is what to check first
            raise MaskError(f"{f.source!r}: draft_token_num {given} asks for {needed:,.0f} custom_mask cells "
                            f"(draft_token_num x (seq_len + draft_token_num) per request), and custom_mask holds {flat.size}: "
                            f"give the drafts each request verifies, or the whole mask")
        raise MaskError(f"{f.source!r}: custom_mask holds {flat.size} cells; the requests' (new x seq_len) masks need {needed:,.0f}")
    return {r: flat[indptr[r]:indptr[r] + sizes[r]].reshape(new[r], seq_lens[r]) for r in range(len(new)) if sizes[r]}
