"""Batch metadata built the way each engine's own code builds it, from one description of the requests.

A request is (computed, new, pages): `computed` tokens already cached, `new` scheduled this step, and the
physical page of each logical block of its computed + new keys. Each builder follows the engine's source:

- vLLM: vllm/v1/worker/gpu_model_runner.py `_prepare_inputs` (query_start_loc = cumsum of scheduled tokens,
  seq_lens = num_computed_tokens + scheduled, positions = computed + arange) and vllm/v1/worker/block_table.py
  `compute_slot_mapping` (slot = block_table[req, pos // block_size] * block_size + pos % block_size); the block
  table is zero-filled past a request's blocks (block 0 is BlockPool's null_block).
- SGLang: python/sglang/srt/managers/schedule_batch.py `prepare_for_extend` (extend_lens = seq_lens - prefix_lens,
  req_to_token[req_pool_idx, prefix_len:seq_len] = out_cache_loc, positions = prefix + arange); a paged allocator
  (mem_cache/allocator.py PagedTokenToKVPoolAllocator) gives a page's slots page * page_size + offset.
- flash-attn: flash_attn_with_kvcache / flash_attn_varlen_func's cu_seqlens_q, seqused_k, block_table, page_block_size.
- FlashInfer: the paged-KV layout of docs (flashinfer/prefill.py BatchPrefillWithPagedKVCacheWrapper.plan):
  kv_indptr over pages, kv_last_page_len = (kv_len - 1) % page_size + 1.
- TensorRT-LLM: tensorrt_llm/_torch/attention_backend/trtllm.py TrtllmAttentionMetadata.prepare
  (kv_lens = num_cached_tokens_per_seq + seq_lens; seq_lens are new tokens); kv_cache_block_offsets (pools, R, 2, blocks)
  as trtllm() below says; spec-dec buffers as with_tree's docstring says. Cited by function and quoted comment, not
  line: the repository (2.5 GB) could not be fetched whole here, only searched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Req:
    computed: int
    new: int
    pages: list[int] = field(default_factory=list)

    @property
    def seq(self) -> int:
        return self.computed + self.new


def allocate(reqs: list[Req], ps: int, first: int = 1, shared: int = 0) -> list[Req]:
    """Give each request fresh pages from `first` on; the first `shared` blocks of a later request are request 0's
    where they are full and cached (vLLM's prefix cache shares only full blocks)."""
    page = first
    for i, r in enumerate(reqs):
        blocks = -(-r.seq // ps)
        r.pages = []
        for b in range(blocks):
            if i > 0 and b < shared and (b + 1) * ps <= r.computed:  # only full, cached blocks are shared
                r.pages.append(reqs[0].pages[b])
            else:
                r.pages.append(page)
                page += 1
    return reqs


def _positions(reqs):
    return np.concatenate([np.arange(r.computed, r.seq) for r in reqs]) if reqs else np.zeros(0, np.int64)


def _table(reqs, width=None, pad=0):
    width = width or max(len(r.pages) for r in reqs)
    table = np.full((len(reqs), width), pad, np.int64)
    for i, r in enumerate(reqs):
        table[i, : len(r.pages)] = r.pages
    return table


def _slots(reqs, ps):
    table = _table(reqs)
    pos = _positions(reqs)
    req = np.repeat(np.arange(len(reqs)), [r.new for r in reqs])
    return table[req, pos // ps] * ps + pos % ps


def _cumulative(values):
    return np.concatenate([[0], np.cumsum(values)]).astype(np.int64)


def vllm(reqs, ps, **extra):
    return dict(query_start_loc=_cumulative([r.new for r in reqs]), seq_lens=np.array([r.seq for r in reqs]),
                num_computed_tokens_cpu=np.array([r.computed for r in reqs]), block_table_tensor=_table(reqs),
                slot_mapping=_slots(reqs, ps), block_size=ps, positions=_positions(reqs), causal=1, **extra)


def sglang(reqs, ps, **extra):
    width = max(-(-r.seq // ps) for r in reqs) * ps
    pool = np.zeros((len(reqs) + 2, width), np.int64)
    rows = np.arange(len(reqs))[::-1] + 1  # pool rows are not in batch order
    for i, r in enumerate(reqs):
        pos = np.arange(r.seq)
        pool[rows[i], : r.seq] = np.array(r.pages)[pos // ps] * ps + pos % ps
    out = np.concatenate([pool[rows[i], r.computed:r.seq] for i, r in enumerate(reqs)])
    return dict(seq_lens=np.array([r.seq for r in reqs]), extend_prefix_lens=np.array([r.computed for r in reqs]),
                extend_seq_lens=np.array([r.new for r in reqs]), req_to_token=pool, req_pool_indices=rows, out_cache_loc=out,
                page_size=ps, positions=_positions(reqs), **extra)


def flash_attn(reqs, ps, **extra):
    return dict(cu_seqlens_q=_cumulative([r.new for r in reqs]), seqused_k=np.array([r.seq for r in reqs]),
                block_table=_table(reqs), page_block_size=ps, causal=1, **extra)


def flashinfer(reqs, ps, **extra):
    return dict(qo_indptr=_cumulative([r.new for r in reqs]), paged_kv_indptr=_cumulative([len(r.pages) for r in reqs]),
                paged_kv_indices=np.concatenate([r.pages for r in reqs]), paged_kv_last_page_len=np.array([(r.seq - 1) % ps + 1 for r in reqs]),
                page_size=ps, causal=1, **extra)


def trtllm(reqs, ps, layers=3, **extra):
    """K offset = flat_index3(pool block, layer 0, field 0, layers, 2) = 2 * layers * block, V = K + 1
    (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp BlockManager::getKOrVBlockIndex and KVCacheManager::setOffsets)."""
    k = _table(reqs) * 2 * layers
    return dict(seq_lens=np.array([r.new for r in reqs]), num_cached_tokens_per_seq=np.array([r.computed for r in reqs]),
                kv_cache_block_offsets=np.stack([k, k + 1], 1)[None], tokens_per_block=ps, **extra)


def page_names(engine, pages):
    """The pages as serve names them: TensorRT-LLM's by their K offset (2 x layers x block, trtllm above), others by id."""
    return [p * 2 * 3 for p in pages] if engine == "trtllm" else list(pages)


BUILDERS = {"vllm": vllm, "sglang": sglang, "flash_attn": flash_attn, "flashinfer": flashinfer, "trtllm": trtllm}
WINDOW = {"vllm": lambda w: {"sliding_window": w}, "sglang": lambda w: {"sliding_window_size": w - 1},
          "flash_attn": lambda w: {"window_size": np.array([w - 1, 0])}, "flashinfer": lambda w: {"window_left": w - 1},
          "trtllm": lambda w: {"attention_window_size": w}}


def ancestors(parents) -> np.ndarray:
    """bool (n, n): node i sees j where j is i or an ancestor (a double loop up the parent chain)."""
    n = len(parents)
    out = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            out[i, j] = True
            j = parents[j]
    return out


def depths(parents) -> list[int]:
    out = []
    for i, p in enumerate(parents):
        out.append(0 if p < 0 else out[p] + 1)
    return out


def vllm_local(reqs, ps, chunk):
    """vLLM's make_local_attention_virtual_batches (vllm/v1/attention/backends/utils.py): each request's queries cut at
    multiples of attn_chunk_size; a virtual batch's keys run from its chunk's start to its last query; its block table
    row is the request's blocks from chunk_start // block_size."""
    q_lens, k_lens, rows = [], [], []
    for r in reqs:
        pos = np.arange(r.computed, r.seq)
        for c in np.unique(pos // chunk):
            mine = pos[pos // chunk == c]
            start = int(c) * chunk
            q_lens.append(mine.size)
            k_lens.append(int(mine[-1]) + 1 - start)
            rows.append(r.pages[start // ps:])
    width = max(map(len, rows))
    table = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return dict(vllm(reqs, ps), attention_chunk_size=chunk, local_query_start_loc=_cumulative(q_lens),
                local_seqused_k=np.array(k_lens), local_block_table=table)


def causal_cells(q_len: int, seq: int) -> np.ndarray:
    """Bottom-right causal (q_len, seq) by a double loop: query i at position seq - q_len + i sees keys up to it."""
    return np.array([[j <= seq - q_len + i for j in range(seq)] for i in range(q_len)], bool).reshape(q_len, seq)


def with_tree(engine, reqs, ps, parents, cells=None, positions=None):
    """The batch with its last request a draft tree verify (its new tokens are the tree's nodes): FlashInfer's
    flattened custom_mask over every request (the others causal), TensorRT-LLM's spec_decoding_packed_mask (bit j of
    node i's int32 word j // 32: node i sees draft j) with the tree a generation request after the contexts, SGLang's
    target-verify batch (below). TensorRT-LLM: interface.py AttentionMetadata.update_spec_dec_param's docstring
    ("num_contexts ... context (prefill) requests in the mixed batch, occupying the leading rows"), and trtllm.py
    TrtllmAttentionMetadata.update_spec_dec_param ("accessed consecutively (without padding) in the attention Op");
    with one generation request the (1, n, words) buffer is also its consecutive rows."""
    tree = reqs[-1]
    n = len(parents)
    if engine == "sglang":
        return sglang_verify(reqs, ps, parents, cells, positions)
    if cells is None:
        cells = np.concatenate([np.ones((n, tree.computed), bool), ancestors(parents)], 1)
    if positions is None:
        positions = np.array(depths(parents)) + tree.computed
    if engine == "trtllm":
        words = np.zeros((1, n, -(-n // 32)), np.int64)
        for i in range(n):
            for j in range(n):
                if cells[i, tree.computed + j]:
                    words[0, i, j // 32] |= 1 << (j % 32)
        words = np.where(words >= 1 << 31, words - (1 << 32), words)  # as the int32 words are stored
        return trtllm(reqs, ps, num_contexts=len(reqs) - 1, spec_decoding_packed_mask=words.astype(np.int32),
                      spec_decoding_position_offsets=(positions - tree.computed)[None])
    flat = np.concatenate([causal_cells(r.new, r.seq).ravel() for r in reqs[:-1]] + [cells.ravel()])
    return flashinfer(reqs, ps, custom_mask=flat.astype(np.int64))


def sglang_verify(reqs, ps, parents, cells=None, positions=None):
    """SGLang's EAGLE target-verify batch: every request verifies the same number n of drafts (the earlier ones a chain,
    topk 1; `reqs` are changed in place to n new tokens and their pages reallocated), seq_lens WITHOUT the drafts and
    custom_mask per request (n, seq_len + n) flattened (python/sglang/srt/speculative/eagle_utils.py:153-157 and
    189-193 in sglang 0.5.23, build_tree_kernel_efficient's FULL_MASK; eagle_info.py:100-116 generate_attn_arg_prefill
    widens the kernel's key lengths by draft_token_num; layers/attention/flashinfer_backend.py:1025-1030 plans
    target_verify with forward_batch.seq_lens); positions are seq_lens + depth (eagle_utils.py:208-211)."""
    n = len(parents)
    for r in reqs[:-1]:
        r.new = n
    allocate(reqs, ps)
    tree = reqs[-1]
    if cells is None:
        cells = np.concatenate([np.ones((n, tree.computed), bool), ancestors(parents)], 1)
    if positions is None:
        positions = np.array(depths(parents)) + tree.computed
    out = sglang(reqs, ps)
    del out["extend_seq_lens"], out["extend_prefix_lens"]
    out["seq_lens"] = np.array([r.computed for r in reqs])
    out["custom_mask"] = np.concatenate([causal_cells(n, r.seq).ravel() for r in reqs[:-1]] + [cells.ravel()])
    out["positions"] = np.concatenate([out["positions"][: -n], positions])
    return out
