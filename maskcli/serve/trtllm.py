"""TensorRT-LLM's PyTorch-flow attention metadata (tensorrt_llm/_torch/attention_backend/trtllm.py, interface.py).

seq_lens (R): this step's new tokens per request (TrtllmAttentionMetadata.prepare computes
kv_lens = num_cached_tokens_per_seq + seq_lens); num_cached_tokens_per_seq (R);
kv_cache_block_offsets (pools, R, 2, blocks), (R, 2, blocks) or (R, blocks): each logical
block's K and V offsets; the K offsets of pool 0 are read as the pages: KVCacheManager::setOffsets
writes flat_index3(pool block index, layer 0, K=0/V=1, layers, 2), one distinct value per block
(2 x layers x its index in the pool), so pages are named by their K offset. tokens_per_block;
attention_window_size (W keys); speculative decoding, generation requests after the
num_contexts context requests: spec_decoding_packed_mask (.., words) int32, bit j of a node's
words = it sees draft j, and spec_decoding_position_offsets: each node's position past the cached
tokens. The attention op reads both consecutively, without padding: generation request g's
rows start after the earlier generation requests' nodes, whatever the buffer's (requests, nodes)
shape (TrtllmAttentionMetadata.update_spec_dec_param).
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.serve.batch import ServeBatch, cumulative, table_rows
from maskcli.serve.fields import Fields
from maskcli.serve.trees import unpack_words

NAME = "trtllm"
TITLE = "TensorRT-LLM attention metadata"
MARKS = ("num_cached_tokens_per_seq", "kv_cache_block_offsets", "tokens_per_block", "attention_window_size", "spec_decoding_packed_mask",
         "spec_decoding_position_offsets", "spec_decoding_generation_lengths")
READS = MARKS + ("seq_lens", "num_contexts")


def load(f: Fields) -> ServeBatch:
    new = f.vector("seq_lens", required=True, why="TensorRT-LLM's seq_lens are each request's new tokens")
    requests = len(new)
    cached = f.per_request(f.vector("num_cached_tokens_per_seq", required=True), requests, "num_cached_tokens_per_seq")
    seq_lens = cached + new
    contexts = f.scalar("num_contexts")  # checked wherever it is given: a count past the requests is no batch
    if contexts is not None and not 0 <= contexts <= requests:
        raise MaskError(f"{f.source!r}: num_contexts {contexts} is not 0 to {requests} (the requests in seq_lens)")
    names = {"queries": "seq_lens", "seq_lens": "num_cached_tokens_per_seq + seq_lens", "computed": "num_cached_tokens_per_seq",
             "table": "kv_cache_block_offsets", "page_size": "tokens_per_block", "window": "attention_window_size"}
    page_size, indptr, pages, short = 0, np.zeros(requests + 1, np.int64), np.zeros(0, np.int64), None
    offsets = f.raw("kv_cache_block_offsets")
    if offsets is not None:
        offsets = np.asarray(offsets, np.int64)
        if offsets.ndim == 4:
            offsets = offsets[0]
        if offsets.ndim == 3:
            if offsets.shape[1] != 2:
                raise MaskError(f"{f.source!r}: kv_cache_block_offsets has shape {list(offsets.shape)}; (R, 2, blocks) holds K and V offsets")
            offsets = offsets[:, 0]
        page_size = f.page_size("tokens_per_block")
        indptr, pages, short = table_rows(offsets, -(-seq_lens // page_size), f"{f.source!r}: kv_cache_block_offsets")
    trees, positions = {}, None
    if f.has("spec_decoding_packed_mask"):
        trees, positions = _trees(f, new, cached)
    # the packed mask holds the drafts only; the cached keys before them are all seen, and not made into cells
    prefix = {r: int(cached[r]) for r in trees}
    window = f.scalar("attention_window_size")
    return ServeBatch(NAME, cumulative(new), seq_lens, page_size, indptr, pages, names, computed=cached, short_table=short,
                      window=window if window is not None and window < int(seq_lens.max(initial=0)) else None, trees=trees, tree_prefix=prefix,
                      positions=positions)


def _trees(f: Fields, new: np.ndarray, cached: np.ndarray):
    words = np.asarray(f.raw("spec_decoding_packed_mask"))
    if words.ndim not in (2, 3) or words.shape[-1] == 0:
        raise MaskError(f"{f.source!r}: spec_decoding_packed_mask has shape {list(words.shape)}; it is (requests, nodes, words)")
    rows = words.reshape(-1, words.shape[-1])  # read consecutively, as the attention op does
    contexts = f.scalar("num_contexts")
    if contexts is None:
        raise MaskError(f"{f.source!r} has spec_decoding_packed_mask but no num_contexts: add it (context requests come first, "
                        f"the mask's rows are the generation requests')")
    if not 0 <= contexts <= len(new):
        raise MaskError(f"{f.source!r}: num_contexts {contexts} is not 0 to {len(new)} (the requests in seq_lens)")
    starts = cumulative(new[contexts:])  # each generation request's first row
    if starts[-1] > len(rows):
        raise MaskError(f"{f.source!r}: the generation requests have {int(starts[-1])} nodes but spec_decoding_packed_mask has "
                        f"{len(rows)} rows (shape {list(words.shape)})")
    trees = {}
    for g, r in enumerate(range(contexts, len(new))):  # a generation request's new tokens are its tree's nodes
        nodes = int(new[r])
        if nodes > 32 * rows.shape[1]:
            raise MaskError(f"{f.source!r}: generation request {r} has {nodes} nodes but {rows.shape[1]} mask words per node")
        drafts = unpack_words(rows[starts[g]:starts[g + 1]], nodes, f"{f.source!r}: spec_decoding_packed_mask")
        trees[r] = drafts
    offsets = f.raw("spec_decoding_position_offsets")
    if offsets is None:
        return trees, None
    offsets = np.asarray(offsets, np.int64).ravel()
    if starts[-1] > offsets.size:
        raise MaskError(f"{f.source!r}: the generation requests have {int(starts[-1])} nodes but spec_decoding_position_offsets "
                        f"holds {offsets.size}")
    positions = [cached[r] + (offsets[starts[r - contexts]:starts[r - contexts + 1]] if r in trees else np.arange(new[r]))
                 for r in range(len(new))]
    return trees, (np.concatenate(positions) if positions else None)
