"""vLLM's CommonAttentionMetadata (vllm/v1/attention/backends/utils.py), as its FlashAttention backend reads it.

query_start_loc (R+1): where each request's new tokens start in q; seq_lens (R): computed plus
new tokens; num_computed_tokens(_cpu) (R); block_table_tensor (R, blocks): physical block per
logical block, block 0 being the null block (BlockPool's null_block); slot_mapping (N): the slot
each new token's K/V is written to, block * block_size + offset, -1 (PAD_SLOT_ID) for padding;
causal; positions (N): each new token's position. vLLM 0.32 has no num_computed_tokens: the cached count is then
read off positions (a request's first new token's position), so a seq_lens that disagrees with it is found. The layer's own: block_size, sliding_window (W keys; the backend passes
window_size=(W-1, 0)), attention_chunk_size. Cascade (FlashAttentionMetadata): common_prefix_len,
cu_prefix_query_lens, prefix_kv_lens, suffix_kv_lens. Chunked-local virtual batches
(make_local_attention_virtual_batches): local_query_start_loc, local_seqused_k, local_block_table.
"""

from __future__ import annotations

import numpy as np

from maskcli.serve.batch import Cascade, Local, ServeBatch, table_rows
from maskcli.serve.fields import Fields

NAME = "vllm"
TITLE = "vLLM CommonAttentionMetadata"
MARKS = ("query_start_loc", "query_start_loc_cpu", "num_computed_tokens_cpu", "num_computed_tokens", "block_table_tensor",
         "slot_mapping", "common_prefix_len", "cu_prefix_query_lens", "prefix_kv_lens", "suffix_kv_lens",
         "local_query_start_loc", "local_seqused_k", "local_block_table")
READS = MARKS + ("seq_lens", "seq_lens_cpu", "causal", "block_size", "sliding_window", "attention_chunk_size", "positions")
NULL_BLOCK = 0  # vllm/v1/core/block_pool.py: the null_block is block_id 0, never allocated


def load(f: Fields) -> ServeBatch:
    seq_lens = f.vector("seq_lens", "seq_lens_cpu", required=True)  # (said missing before the queries are read)
    q_indptr = f.indptr("query_start_loc", "query_start_loc_cpu")
    requests = len(q_indptr) - 1
    seq_lens = f.per_request(seq_lens, requests, "seq_lens", "seq_lens_cpu")
    computed = f.per_request(f.vector("num_computed_tokens_cpu", "num_computed_tokens"), requests, "num_computed_tokens_cpu", "num_computed_tokens")
    names = {"queries": f.key("query_start_loc", "query_start_loc_cpu"), "seq_lens": f.key("seq_lens", "seq_lens_cpu"),
             "computed": f.key("num_computed_tokens_cpu", "num_computed_tokens") or "num_computed_tokens",
             "table": "block_table_tensor", "writes": "slot_mapping", "page_size": "block_size", "window": "sliding_window"}
    positions = f.positions()
    if computed is None and positions is not None and positions.size >= q_indptr[-1]:
        q_lens = np.diff(q_indptr)
        first = positions[np.minimum(q_indptr[:-1], max(positions.size - 1, 0))] if positions.size else q_lens
        computed = np.where(q_lens > 0, first, seq_lens)  # (a request with no new token this step has all its keys cached)
        names["computed"] = "its first position"
    page_size, indptr, pages, short = 0, np.zeros(requests + 1, np.int64), np.zeros(0, np.int64), None
    table = f.raw("block_table_tensor")
    if table is not None:
        page_size = f.page_size("block_size")
        indptr, pages, short = table_rows(np.asarray(table, np.int64), -(-seq_lens // page_size), f"{f.source!r}: block_table_tensor")
    slots = f.vector("slot_mapping")
    tokens = None
    if slots is not None:
        tokens = int(np.count_nonzero(slots != -1))  # PAD_SLOT_ID pads a CUDA graph's batch
        slots = slots[: int(q_indptr[-1])]
    cascade = None
    if f.has("common_prefix_len"):
        cascade = Cascade(f.scalar("common_prefix_len"), f.vector("cu_prefix_query_lens"), f.vector("prefix_kv_lens"), f.vector("suffix_kv_lens"))
        if cascade.prefix_len == 0:
            cascade = None  # vLLM runs plain attention when no prefix is common
    local = None
    if f.has("local_query_start_loc"):
        local = Local(f.indptr("local_query_start_loc"), f.vector("local_seqused_k", required=True),
                      np.asarray(f.raw("local_block_table"), np.int64) if f.has("local_block_table") else np.zeros((0, 0), np.int64))
    return ServeBatch(
        NAME, q_indptr, seq_lens, page_size, indptr, pages, names, computed=computed, short_table=short, null_page=NULL_BLOCK,
        write_slots=slots, tokens=tokens, causal=f.flag("causal", default=True), window=f.scalar("sliding_window"),
        chunk=f.scalar("attention_chunk_size"), cascade=cascade, local=local, positions=positions,
    )
