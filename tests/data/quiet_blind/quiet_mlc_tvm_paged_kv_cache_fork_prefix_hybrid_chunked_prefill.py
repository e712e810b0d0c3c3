"""Correct program (quiet batch quiet-r166a).

MLC-LLM's serving engine over TVM's PagedKVCache, ported to plain torch on CPU.

Ported from apache/tvm @5d4dc8721307cf9677becacf0395c19be130e206:
  src/runtime/vm/attn_utils.h (Block, Sequence, GetBlockIdsOnDepth, GetChunkedBlockIds,
    kPagedKVCacheMaxBlockDepth = 2),
  src/runtime/vm/paged_kv_cache.cc (AddSequence, RemoveSequence, ForkSequence with the partial-page
    copy, PopN, BeginForward's per-depth qo_indptr / page_indptr / page_indices / last_page_len /
    k_rope_pos_offset and q_rope_position_map / append_position_map, ReserveAppendLengthInSeq,
    AttentionWithFusedQKV, AttentionInternal, MHASelfAttnInternal, MHACrossAttnInternal),
  python/tvm/relax/frontend/nn/llm/_prefill_kernels.py (_attention_prefill_cpu,
    _attention_prefill_ragged_cpu), _decode_kernels.py (_attention_decode_cpu,
    _merge_state_inplace_cpu), _page_kernels.py (_kv_cache_transpose_append, _copy_single_page),
    _kernel_common.py (_causal_mask, _get_kv_chunk_len, _get_seq_offset);
and mlc-ai/mlc-llm: python/mlc_llm/model/llama/llama_model.py @01ced331a9e155c5ba4e7625b027a51bee611450
  (LlamaAttention.forward: fused qkv_proj reshaped to (b, s, h_q + 2 h_kv, d) and handed to
  attention_with_fused_qkv; batch_prefill with logit_positions), cpp/serve/prefix_cache.cc
  @1235922c4c58e3782a9f1d7c2757bcd54a00ebf9 (PrefixCacheImpl.InsertSequence: fork an active sequence at
  the matched offset, roll back the last token on a full match, reuse a recycling sequence with a
  roll back).

What the cache does with masks: a prefill batch (some append length != 1) attends in two parts and
merges them by log-sum-exp: a ragged causal self-attention over only the new tokens of each sequence
(_causal_mask: col < kv_len - qo_len + row + 1 with kv_len == qo_len), and a non-causal paged
attention of those queries over the KV already in the cache, one call per block depth (a shared
prefix block is depth 0; sequences that sit next to each other in the batch and share it are
coalesced into one qo range). An all-decode batch appends first and runs the paged decode kernel per
depth. Entries with no pages give lse = -5e4 and drop out of the merge. RoPE mode is "normal": q and
k are rotated at q_rope_position_map before the k is appended.

The engine runs hybrid steps (decodes of running requests and prefill chunks in one batch, at most
prefill_chunk_size tokens), forks new requests from active ones at the prefix-cache match (mid-page,
page-aligned, and a third-level fork that leaves a trailing block past depth 2), removes finished
ones, and rolls back a recycled one for a request that matches it.

Self-check: every hidden state the engine computes (every token of every chunk, every decode) gives
the same logits as each request run alone through a hand-written per-query causal softmax over its
own tokens (the reference is checked first against transformers' LlamaForCausalLM), and the greedy
tokens are the same.
"""
import math

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)

kPagedKVCacheMaxBlockDepth = 2
LOG2E = math.log2(math.exp(1))


# --------------------------------------------------------------------------- attn_utils.h
class Block:
    def __init__(self, index):
        self.index = index
        self.reset()

    def reset(self):
        self.page_ids = []
        self.seq_length = 0
        self.start_pos = 0
        self.sink_length = 0
        self.sliding_window_offset = 0
        self.parent_idx = -1
        self.external_ref_cnt = 0


class Sequence:
    def __init__(self, global_block_pool, last_block_idx):
        global_block_pool[last_block_idx].external_ref_cnt += 1
        self.last_block_idx = last_block_idx
        self.seq_length = 0
        self.accepted_indices_committed = True
        block_ptr = last_block_idx
        while True:
            block = global_block_pool[block_ptr]
            self.seq_length += block.seq_length
            if block.parent_idx == -1:
                break
            block_ptr = block.parent_idx

    def get_block_trace(self, global_block_pool):
        trace = []
        block_ptr = self.last_block_idx
        while block_ptr != -1:
            trace.append(block_ptr)
            block_ptr = global_block_pool[block_ptr].parent_idx
        return trace[::-1]


def get_block_ids_on_depth(sequences, global_block_pool, batch_size):
    num_depths = 0
    seq_block_traces, trailing_block_traces = [], []
    for i in range(batch_size):
        trace = sequences[i].get_block_trace(global_block_pool)
        if len(trace) <= kPagedKVCacheMaxBlockDepth:
            seq_block_traces.append(trace)
            trailing_block_traces.append([])
            num_depths = max(num_depths, len(trace))
        else:
            seq_block_traces.append(trace[:kPagedKVCacheMaxBlockDepth])
            trailing_block_traces.append(trace[kPagedKVCacheMaxBlockDepth:])
            num_depths = max(num_depths, kPagedKVCacheMaxBlockDepth)
    block_ids_on_depths = []
    for d in range(num_depths):
        block_ids_on_depths.append(
            [seq_block_traces[i][d] if d < len(seq_block_traces[i]) else -1 for i in range(batch_size)]
        )
    return block_ids_on_depths, trailing_block_traces


def get_chunked_block_ids(block_ids, enable_coalesce, append_lengths, global_block_pool, is_decode_request):
    uncoalesced_block_ids, coalesced_block_ids = [], []
    cur_block_id = block_ids[0]
    chunk_append_length = append_lengths[0]
    page_counter_coalesced = 0
    page_counter_uncoalesced = len(global_block_pool[block_ids[0]].page_ids) if block_ids[0] != -1 else 0
    for i in range(1, len(block_ids)):
        if block_ids[i] != -1:
            page_counter_uncoalesced += len(global_block_pool[block_ids[i]].page_ids)
        uncoalesced_block_ids.append((block_ids[i - 1], append_lengths[i - 1]))
        if block_ids[i] == cur_block_id:
            chunk_append_length += append_lengths[i]
        else:
            coalesced_block_ids.append((cur_block_id, chunk_append_length))
            if cur_block_id != -1:
                page_counter_coalesced += len(global_block_pool[cur_block_id].page_ids)
            cur_block_id = block_ids[i]
            chunk_append_length = append_lengths[i]
    uncoalesced_block_ids.append((block_ids[-1], append_lengths[-1]))
    coalesced_block_ids.append((cur_block_id, chunk_append_length))
    if cur_block_id != -1:
        page_counter_coalesced += len(global_block_pool[cur_block_id].page_ids)
    coalesce_ratio = page_counter_uncoalesced / page_counter_coalesced if page_counter_coalesced > 0 else 0.0
    use_decode_kernel = is_decode_request and coalesce_ratio < 32
    return (uncoalesced_block_ids if use_decode_kernel or not enable_coalesce else coalesced_block_ids), use_decode_kernel


# --------------------------------------------------------------------------- TIR CPU kernels
def _causal_mask(causal, row, col, kv_len, qo_len):
    return (col < kv_len - qo_len + row + 1) if causal > 0 else (col < kv_len)


def _get_kv_chunk_len(num_pages, page_size, seq_id, length_info):
    return (num_pages - 1) * page_size + int(length_info[seq_id])


def _get_seq_offset(pos, seq_id, length_info):
    return pos


def batch_prefill_ragged_kv(q, q_indptr, k, v, kv_indptr, causal, rotary_mode, sm_scale):
    """_attention_prefill_ragged_cpu: masked scores are -5e4 * log2(e) * sm_scale, lse in log2."""
    assert rotary_mode == 0
    qo_len_total, h_q, d = q.shape
    group_size = h_q // k.shape[1]
    output = torch.zeros(qo_len_total, h_q, v.shape[2])
    lse = torch.zeros(qo_len_total, h_q)
    for b in range(len(q_indptr) - 1):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        qo_len, kv_len = q1 - q0, k1 - k0
        if qo_len == 0:
            continue
        qb = q[q0:q1]                                             # (qo, H, D)
        kb = k[k0:k1].repeat_interleave(group_size, dim=1)        # (kv, H, D)
        vb = v[k0:k1].repeat_interleave(group_size, dim=1)
        rows = torch.arange(qo_len)[:, None]
        cols = torch.arange(kv_len)[None, :]
        mask = _causal_mask(causal, rows, cols, kv_len, qo_len)   # (qo, kv)
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * LOG2E * sm_scale
        scores = torch.where(mask[None], scores, torch.full_like(scores, -5e4 * LOG2E * sm_scale))
        m_prev = torch.full((h_q, qo_len, 1), -5e4)
        m_new = torch.maximum(m_prev, scores.amax(-1, keepdim=True))
        exp_scores = torch.exp2(scores - m_new)
        d_new = 1.0 * torch.exp2(m_prev - m_new) + exp_scores.sum(-1, keepdim=True)
        output[q0:q1] = torch.einsum("hqk,khd->qhd", exp_scores / d_new, vb)
        lse[q0:q1] = (m_new + torch.log2(d_new))[..., 0].T
    return output, lse


def _gather_paged_kv(pages, page_values, begin, kv_chunk_len, page_size, b_idx, length_info):
    rows = []
    for row_idx in range(kv_chunk_len):
        seq_offset = _get_seq_offset(row_idx, b_idx, length_info)
        page_no = int(page_values[begin + seq_offset // page_size])
        rows.append(pages[page_no, :, :, seq_offset % page_size, :])   # (2, H_kv, D)
    if not rows:
        return pages.new_zeros(0, pages.shape[2], pages.shape[4]), pages.new_zeros(0, pages.shape[2], pages.shape[4])
    kv = torch.stack(rows, 0)
    return kv[:, 0], kv[:, 1]


def batch_prefill_paged_kv_cpu(q, q_indptr, pages, page_indptr, page_values, length_info,
                               k_rope_pos_offset, q_rope_position, causal, rotary_mode, sm_scale):
    """_attention_prefill_cpu (no sliding window): online softmax starting from m = -5e4, d = 1."""
    assert rotary_mode == 0
    total_len, h_q, d = q.shape
    page_size = pages.shape[3]
    group_size = h_q // pages.shape[2]
    output = torch.zeros(total_len, h_q, d)
    lse = torch.zeros(total_len, h_q)
    for b_idx in range(len(q_indptr) - 1):
        begin, end = int(page_indptr[b_idx]), int(page_indptr[b_idx + 1])
        kv_chunk_len = _get_kv_chunk_len(end - begin, page_size, b_idx, length_info) if begin != end else 0
        q0, q1 = int(q_indptr[b_idx]), int(q_indptr[b_idx + 1])
        qo_len = q1 - q0
        if qo_len == 0:
            continue
        kb, vb = _gather_paged_kv(pages, page_values, begin, kv_chunk_len, page_size, b_idx, length_info)
        kb = kb.repeat_interleave(group_size, dim=1)
        vb = vb.repeat_interleave(group_size, dim=1)
        S = torch.einsum("qhd,khd->hqk", q[q0:q1], kb) * sm_scale * LOG2E
        mask = _causal_mask(causal, torch.arange(qo_len)[:, None], torch.arange(kv_chunk_len)[None, :],
                            kv_chunk_len, qo_len)
        S = torch.where(mask[None], S, torch.full_like(S, -5e4))
        m0 = torch.full((h_q, qo_len, 1), -5e4)
        m = torch.maximum(m0, S.amax(-1, keepdim=True)) if kv_chunk_len > 0 else m0
        p = torch.exp2(S - m)
        d_val = 1.0 * torch.exp2(m0 - m) + p.sum(-1, keepdim=True)
        output[q0:q1] = torch.einsum("hqk,khd->qhd", p, vb) / d_val.permute(1, 0, 2)
        lse[q0:q1] = (m + torch.log2(d_val))[..., 0].T
    return output, lse


def batch_decode_paged_kv(Q, pages, page_table_indptr, page_table_values, length_info,
                          k_rope_pos_offset, q_rope_position, rotary_mode, sm_scale):
    """_attention_decode_cpu: one query per batch entry, every row of its pages visible."""
    q_indptr = torch.arange(Q.shape[0] + 1, dtype=torch.int32)
    return batch_prefill_paged_kv_cpu(Q, q_indptr, pages, page_table_indptr, page_table_values, length_info,
                                      k_rope_pos_offset, q_rope_position, 0, rotary_mode, sm_scale)


def merge_state_inplace_cpu(V, S, V_other, S_other):
    s_max = torch.maximum(S, S_other)
    s_val = torch.exp2(S - s_max)
    s_other_val = torch.exp2(S_other - s_max)
    scale = s_val / (s_val + s_other_val)
    other_scale = s_other_val / (s_val + s_other_val)
    V.copy_(V * scale[..., None] + V_other * other_scale[..., None])
    S.copy_(torch.log2(s_val + s_other_val) + s_max)


def tir_kv_cache_transpose_append(pages, k_data, v_data, position_map):
    page_size = pages.shape[3]
    for global_pos in range(k_data.shape[0]):
        position = int(position_map[global_pos])
        if position != -1:
            pages[position // page_size, 0, :, position % page_size, :] = k_data[global_pos]
            pages[position // page_size, 1, :, position % page_size, :] = v_data[global_pos]


def copy_single_page(pages, src_page_id, tgt_page_id, copy_length):
    pages[tgt_page_id, :, :, :copy_length, :] = pages[src_page_id, :, :, :copy_length, :]


def llama_rope_with_position_map(x, positions, theta):
    """position_embedding.py rope_freq_default: freq = pos / theta^((2 d) % rd / rd), rotate-half layout."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


# --------------------------------------------------------------------------- paged_kv_cache.cc
class PagedAttentionKVCache:
    def __init__(self, num_layers, num_qo_heads, num_kv_heads, head_dim, page_size, num_total_pages, rotary_theta):
        self.num_layers_ = num_layers
        self.num_qo_heads_ = num_qo_heads
        self.num_kv_heads_ = num_kv_heads
        self.head_dim_ = head_dim
        self.page_size_ = page_size
        self.num_total_pages_ = num_total_pages
        self.rotary_theta_ = rotary_theta
        self.support_sliding_window_ = False
        self.rope_mode_ = 1  # RoPEMode::kNormal
        self.pages_ = [torch.zeros(num_total_pages, 2, num_kv_heads, page_size, head_dim) for _ in range(num_layers)]
        self.seq_map_ = {}
        self.global_block_pool_ = []
        self.free_block_idx_ = []
        self.free_page_ids_ = list(range(num_total_pages - 1, -1, -1))
        self.last_forward_info = None

    # ---- sequence management
    def GetFreePage(self):
        assert self.free_page_ids_, "The KV cache is full. No page can be allocated."
        return self.free_page_ids_.pop()

    def GetFreeBlock(self):
        if self.free_block_idx_:
            block_idx = self.free_block_idx_.pop()
            self.global_block_pool_[block_idx].reset()
            return block_idx
        block_idx = len(self.global_block_pool_)
        self.global_block_pool_.append(Block(block_idx))
        return block_idx

    def AddSequence(self, seq_id):
        assert seq_id not in self.seq_map_
        block_idx = self.GetFreeBlock()
        self.seq_map_[seq_id] = Sequence(self.global_block_pool_, block_idx)

    def RemoveSequence(self, seq_id):
        seq = self.seq_map_[seq_id]
        pool = self.global_block_pool_
        block_idx = seq.last_block_idx
        assert pool[block_idx].external_ref_cnt >= 1
        while block_idx != -1 and pool[block_idx].external_ref_cnt == 1:
            self.free_page_ids_.extend(pool[block_idx].page_ids)
            self.free_block_idx_.append(block_idx)
            block_idx = pool[block_idx].parent_idx
        if block_idx != -1:
            assert pool[block_idx].external_ref_cnt > 1
            pool[block_idx].external_ref_cnt -= 1
        del self.seq_map_[seq_id]

    def ForkSequence(self, parent_seq_id, child_seq_id, fork_pos=-1):
        pool = self.global_block_pool_
        parent = self.seq_map_[parent_seq_id]
        assert child_seq_id not in self.seq_map_
        assert -1 <= fork_pos <= parent.seq_length
        if fork_pos == -1:
            fork_pos = parent.seq_length
        if fork_pos == parent.seq_length and fork_pos % self.page_size_ == 0 and pool[parent.last_block_idx].seq_length > 0:
            new_block_idx = self.GetFreeBlock()
            pool[new_block_idx].start_pos = parent.seq_length
            pool[new_block_idx].parent_idx = parent.last_block_idx
            pool[new_block_idx].external_ref_cnt = 1
            parent.last_block_idx = new_block_idx

        child_block_idx = self.GetFreeBlock()
        trace = parent.get_block_trace(pool)
        in_block_offset = fork_pos
        for forked_block_idx in trace:
            if forked_block_idx != trace[-1]:
                assert pool[forked_block_idx].seq_length > 0
                assert pool[forked_block_idx].seq_length % self.page_size_ == 0
                if pool[forked_block_idx].seq_length <= in_block_offset:
                    in_block_offset -= pool[forked_block_idx].seq_length
                    continue
            in_page_offset = in_block_offset % self.page_size_
            moved_offset = in_block_offset - in_page_offset
            moved_pages = moved_offset // self.page_size_
            if moved_pages == 0:
                parent_block_idx = pool[forked_block_idx].parent_idx
                if parent_block_idx != -1:
                    pool[parent_block_idx].external_ref_cnt += 1
                pool[child_block_idx].parent_idx = parent_block_idx
            else:
                parent_block_idx = self.GetFreeBlock()
                pool[parent_block_idx].parent_idx = pool[forked_block_idx].parent_idx
                pool[forked_block_idx].parent_idx = parent_block_idx
                pool[child_block_idx].parent_idx = parent_block_idx
                pool[parent_block_idx].external_ref_cnt = 2
                pool[parent_block_idx].page_ids = pool[forked_block_idx].page_ids[:moved_pages]
                pool[forked_block_idx].page_ids = pool[forked_block_idx].page_ids[moved_pages:]
                pool[parent_block_idx].start_pos = pool[forked_block_idx].start_pos
                pool[forked_block_idx].start_pos += moved_offset
                pool[parent_block_idx].seq_length = moved_offset
                pool[forked_block_idx].seq_length -= moved_offset
            pool[child_block_idx].start_pos = fork_pos - in_page_offset
            pool[child_block_idx].seq_length = in_page_offset
            if in_page_offset > 0:
                src_page_id = pool[forked_block_idx].page_ids[0]
                tgt_page_id = self.GetFreePage()
                pool[child_block_idx].page_ids.append(tgt_page_id)
                for layer in range(self.num_layers_):
                    copy_single_page(self.pages_[layer], src_page_id, tgt_page_id, in_page_offset)
            break
        self.seq_map_[child_seq_id] = Sequence(pool, child_block_idx)

    def PopN(self, seq_id, n):
        seq = self.seq_map_[seq_id]
        pool = self.global_block_pool_
        assert 0 <= n <= seq.seq_length
        if n == 0:
            return
        block_idx = seq.last_block_idx
        while block_idx != -1 and pool[block_idx].external_ref_cnt == 1:
            if n > pool[block_idx].seq_length:
                n -= pool[block_idx].seq_length
                seq.seq_length -= pool[block_idx].seq_length
                self.free_page_ids_.extend(pool[block_idx].page_ids)
                self.free_block_idx_.append(block_idx)
                block_idx = pool[block_idx].parent_idx
                seq.last_block_idx = block_idx
                continue
            cur_npage = len(pool[block_idx].page_ids)
            tgt_npage = (pool[block_idx].seq_length - n + self.page_size_ - 1) // self.page_size_
            while cur_npage > tgt_npage:
                self.free_page_ids_.append(pool[block_idx].page_ids.pop())
                cur_npage -= 1
            seq.seq_length -= n
            pool[block_idx].seq_length -= n
            n = 0
            break
        assert n == 0, "the fork-and-remove branch of PopN is not ported"

    def ReserveAppendLengthInSeq(self, seq, append_length):
        block = self.global_block_pool_[seq.last_block_idx]
        assert append_length > 0
        assert block.external_ref_cnt == 1
        cur_npage = len(block.page_ids)
        tgt_npage = (block.seq_length - block.sink_length + block.sliding_window_offset + append_length
                     + self.page_size_ - 1) // self.page_size_
        for _ in range(cur_npage, tgt_npage):
            block.page_ids.append(self.GetFreePage())
        block.seq_length += append_length

    # ---- attention metadata
    def BeginForward(self, seq_ids, append_lengths):
        pool = self.global_block_pool_
        self.cur_batch_size_ = len(seq_ids)
        self.cur_seq_ids_ = list(seq_ids)
        self.cur_append_lengths_ = list(append_lengths)
        sequences, last_block_length_before_append, k_ragged_rope_pos_offset = [], [], []
        is_decode_request = True
        for i, seq_id in enumerate(seq_ids):
            seq = self.seq_map_[seq_id]
            sequences.append(seq)
            last_block_length_before_append.append(pool[seq.last_block_idx].seq_length)
            k_ragged_rope_pos_offset.append(seq.seq_length)
            seq.seq_length += append_lengths[i]
            if append_lengths[i] != 1:
                is_decode_request = False

        block_ids_on_depths, trailing_blocks = get_block_ids_on_depth(sequences, pool, self.cur_batch_size_)
        self.num_depths_ = min(len(block_ids_on_depths), kPagedKVCacheMaxBlockDepth)
        chunked_block_ids_arr = []
        self.use_decode_kernel_ = []
        for d in range(self.num_depths_):
            chunked, use_decode = get_chunked_block_ids(
                block_ids_on_depths[d], d != kPagedKVCacheMaxBlockDepth - 1, self.cur_append_lengths_, pool,
                is_decode_request)
            chunked_block_ids_arr.append(chunked)
            self.use_decode_kernel_.append(use_decode)
        self.append_before_attn_ = (not self.support_sliding_window_) and self.use_decode_kernel_[-1]

        if self.append_before_attn_:
            for i in range(self.cur_batch_size_):
                self.ReserveAppendLengthInSeq(sequences[i], append_lengths[i])

        self.qo_indptr_on_depths_, self.page_indptr_on_depths_, self.page_indices_on_depths_ = [], [], []
        self.length_info_on_depths_, self.k_rope_pos_offset_on_depths_ = [], []
        for d in range(self.num_depths_):
            qo_indptr_h, page_indptr_h, page_indices_h = [0], [0], []
            last_page_len_h, k_rope_pos_offset_h = [], []
            for i, (block_id, chunk_append_length) in enumerate(chunked_block_ids_arr[d]):
                qo_indptr_h.append(qo_indptr_h[-1] + chunk_append_length)
                if block_id == -1:
                    page_indptr_h.append(page_indptr_h[-1])
                    last_page_len_h.append(0)
                    k_rope_pos_offset_h.append(0)
                elif d < kPagedKVCacheMaxBlockDepth - 1:
                    block = pool[block_id]
                    page_indptr_h.append(page_indptr_h[-1] + len(block.page_ids))
                    page_indices_h.extend(block.page_ids)
                    last_page_len_h.append(0 if block.seq_length == 0 else
                                           (block.seq_length - block.sink_length + block.sliding_window_offset - 1)
                                           % self.page_size_ + 1)
                    k_rope_pos_offset_h.append(block.start_pos)
                else:
                    block = pool[block_id]
                    num_pages = len(block.page_ids)
                    total_seq_length = block.seq_length
                    last_block_id = block_id
                    page_indices_h.extend(block.page_ids)
                    for tid in trailing_blocks[i]:
                        tblock = pool[tid]
                        page_indices_h.extend(tblock.page_ids)
                        num_pages += len(tblock.page_ids)
                        total_seq_length += tblock.seq_length
                        last_block_id = tid
                    page_indptr_h.append(page_indptr_h[-1] + num_pages)
                    last_block = pool[last_block_id]
                    last_page_len_h.append(0 if total_seq_length == 0 else
                                           (total_seq_length - last_block.sink_length
                                            + last_block.sliding_window_offset - 1) % self.page_size_ + 1)
                    k_rope_pos_offset_h.append(block.start_pos)
            self.qo_indptr_on_depths_.append(torch.tensor(qo_indptr_h, dtype=torch.int32))
            self.page_indptr_on_depths_.append(torch.tensor(page_indptr_h, dtype=torch.int32))
            self.page_indices_on_depths_.append(torch.tensor(page_indices_h, dtype=torch.int32))
            self.length_info_on_depths_.append(torch.tensor(last_page_len_h, dtype=torch.int32))
            self.k_rope_pos_offset_on_depths_.append(torch.tensor(k_rope_pos_offset_h, dtype=torch.int32))

        if not self.append_before_attn_:
            for i in range(self.cur_batch_size_):
                self.ReserveAppendLengthInSeq(sequences[i], append_lengths[i])

        q_rope_position_map, append_position_map = [], []
        for i in range(self.cur_batch_size_):
            append_length = append_lengths[i]
            block = pool[sequences[i].last_block_idx]
            for pos in range(append_length):
                q_rope_position_map.append(k_ragged_rope_pos_offset[i] + pos)
                pos_in_block = block.seq_length - append_length + pos
                if last_block_length_before_append[i] + pos < block.sink_length:
                    offset_in_block = last_block_length_before_append[i] + pos
                    append_position_map.append(block.page_ids[offset_in_block // self.page_size_] * self.page_size_
                                               + offset_in_block % self.page_size_)
                elif pos_in_block < block.sink_length:
                    append_position_map.append(-1)
                else:
                    offset_in_block = pos_in_block - block.sink_length + block.sliding_window_offset
                    append_position_map.append(block.page_ids[offset_in_block // self.page_size_] * self.page_size_
                                               + offset_in_block % self.page_size_)
        self.q_rope_position_map_ = torch.tensor(q_rope_position_map, dtype=torch.int32)
        self.append_position_map_ = torch.tensor(append_position_map, dtype=torch.int32)
        self.k_ragged_rope_pos_offset_ = torch.tensor(k_ragged_rope_pos_offset, dtype=torch.int32)
        indptr = [0]
        for L in append_lengths:
            indptr.append(indptr[-1] + L)
        self.cur_append_length_indptr_ = torch.tensor(indptr, dtype=torch.int32)
        self.last_forward_info = dict(
            num_depths=self.num_depths_, append_before_attn=self.append_before_attn_,
            use_decode_kernel=list(self.use_decode_kernel_),
            entries_per_depth=[len(c) for c in chunked_block_ids_arr],
            trailing=any(len(t) > 0 for t in trailing_blocks), batch_size=self.cur_batch_size_)

    def EndForward(self):
        pass

    # ---- attention
    def AttentionWithFusedQKV(self, layer_id, qkv_data, sm_scale):
        h_q, h_kv = self.num_qo_heads_, self.num_kv_heads_
        total_seq_length = int(self.cur_append_length_indptr_[-1])
        assert qkv_data.shape == (total_seq_length, h_q + 2 * h_kv, self.head_dim_)
        q_data = qkv_data[:, :h_q]
        k_data = qkv_data[:, h_q:h_q + h_kv]
        v_data = qkv_data[:, h_q + h_kv:]
        if self.rope_mode_ == 1:
            q_data = llama_rope_with_position_map(q_data, self.q_rope_position_map_, self.rotary_theta_)
            k_data = llama_rope_with_position_map(k_data, self.q_rope_position_map_, self.rotary_theta_)
        if self.append_before_attn_:
            tir_kv_cache_transpose_append(self.pages_[layer_id], k_data, v_data, self.append_position_map_)
        o_data = torch.zeros(total_seq_length, h_q, self.head_dim_)
        self.AttentionInternal(layer_id, q_data, k_data, v_data, o_data, sm_scale)
        if not self.append_before_attn_:
            tir_kv_cache_transpose_append(self.pages_[layer_id], k_data, v_data, self.append_position_map_)
        return o_data

    def AttentionInternal(self, layer_id, q_data, k_data, v_data, output, sm_scale):
        self.merged_attn_lse_view_ = torch.zeros(q_data.shape[0], self.num_qo_heads_)
        is_first_kernel = True
        if not self.append_before_attn_:
            is_first_kernel = False
            self.MHASelfAttnInternal(q_data, k_data, v_data, output, self.merged_attn_lse_view_, sm_scale)
        self_attn_computed = not is_first_kernel
        cross_attn_computed = self.MHACrossAttnInternal(layer_id, q_data, output, self.merged_attn_lse_view_,
                                                        sm_scale, is_first_kernel, causal=False)
        assert self_attn_computed or cross_attn_computed

    def MHASelfAttnInternal(self, q_data, k_data, v_data, o_data, lse_data, sm_scale):
        o, lse = batch_prefill_ragged_kv(q_data, self.cur_append_length_indptr_, k_data, v_data,
                                         self.cur_append_length_indptr_, causal=1, rotary_mode=0,
                                         sm_scale=sm_scale)
        o_data.copy_(o)
        lse_data.copy_(lse)

    def MHACrossAttnInternal(self, local_layer_id, q_data, o_data, lse_data, sm_scale, is_first_kernel, causal):
        cross_attn_computed = False
        for d in range(self.num_depths_):
            if self.page_indices_on_depths_[d].shape[0] == 0:
                continue
            if self.use_decode_kernel_[d]:
                attn_output, attn_lse = batch_decode_paged_kv(
                    q_data, self.pages_[local_layer_id], self.page_indptr_on_depths_[d],
                    self.page_indices_on_depths_[d], self.length_info_on_depths_[d],
                    self.k_rope_pos_offset_on_depths_[d], self.q_rope_position_map_, 0, sm_scale)
            else:
                attn_output, attn_lse = batch_prefill_paged_kv_cpu(
                    q_data, self.qo_indptr_on_depths_[d], self.pages_[local_layer_id],
                    self.page_indptr_on_depths_[d], self.page_indices_on_depths_[d],
                    self.length_info_on_depths_[d], self.k_rope_pos_offset_on_depths_[d],
                    self.q_rope_position_map_, int(causal), 0, sm_scale)
            if is_first_kernel:
                o_data.copy_(attn_output)
                lse_data.copy_(attn_lse)
                is_first_kernel = False
            else:
                merge_state_inplace_cpu(o_data, lse_data, attn_output, attn_lse)
            cross_attn_computed = True
        return cross_attn_computed


# --------------------------------------------------------------------------- mlc_llm llama_model.py
class MLCLlama:
    """Weights taken from a transformers LlamaForCausalLM, fused as mlc_llm's qkv_proj / gate_up_proj."""

    def __init__(self, hf):
        c = hf.config
        self.h_q, self.h_kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
        self.embed = hf.model.embed_tokens.weight
        self.layers = []
        for layer in hf.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                in_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm,
                qkv_w=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0),
                o_w=a.o_proj.weight,
                gate_up_w=torch.cat([m.gate_proj.weight, m.up_proj.weight], 0),
                down_w=m.down_proj.weight))
        self.norm = hf.model.norm
        self.lm_head = hf.lm_head.weight

    def batch_forward_hidden(self, input_ids, paged_kv_cache):
        h = F.embedding(input_ids, self.embed)                     # (total, hidden): b = 1, s = total
        for layer_id, L in enumerate(self.layers):
            x = L["in_norm"](h)
            qkv = (x @ L["qkv_w"].T).reshape(-1, self.h_q + 2 * self.h_kv, self.d)
            out = paged_kv_cache.AttentionWithFusedQKV(layer_id, qkv, sm_scale=self.d ** -0.5)
            h = h + out.reshape(-1, self.h_q * self.d) @ L["o_w"].T
            x1, x2 = (L["post_norm"](h) @ L["gate_up_w"].T).chunk(2, dim=-1)
            h = h + (F.silu(x1) * x2) @ L["down_w"].T
        return self.norm(h)

    def get_logits(self, hidden):
        return hidden @ self.lm_head.T


# --------------------------------------------------------------------------- reference: each request alone
def reference_logits(hf, tokens):
    """A plain causal forward of one request by hand: per query, softmax over keys 0..i."""
    c = hf.config
    h_q, h_kv = c.num_attention_heads, c.num_key_value_heads
    d = c.hidden_size // h_q
    n = len(tokens)
    pos = torch.arange(n)
    inv_freq = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):  # (n, H, d)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    h = hf.model.embed_tokens.weight[torch.tensor(tokens)]
    for layer in hf.model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = rope((x @ a.q_proj.weight.T).reshape(n, h_q, d))
        k = rope((x @ a.k_proj.weight.T).reshape(n, h_kv, d))
        v = (x @ a.v_proj.weight.T).reshape(n, h_kv, d)
        attn = torch.zeros(n, h_q, d)
        for i in range(n):
            for hh in range(h_q):
                kh = hh // (h_q // h_kv)
                s = (k[: i + 1, kh] @ q[i, hh]) / math.sqrt(d)
                attn[i, hh] = torch.softmax(s, 0) @ v[: i + 1, kh]
        h = h + attn.reshape(n, h_q * d) @ a.o_proj.weight.T
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return hf.model.norm(h) @ hf.lm_head.weight.T


# --------------------------------------------------------------------------- engine (hybrid prefill)
class Request:
    def __init__(self, rid, prompt, max_new_tokens, arrive_step):
        self.rid, self.prompt, self.max_new_tokens, self.arrive_step = rid, list(prompt), max_new_tokens, arrive_step
        self.tokens = list(prompt)
        self.num_committed = 0
        self.seq_id = None
        self.generated = 0
        self.recorded = {}        # absolute position -> logits computed there
        self.forked_from = None


class Engine:
    def __init__(self, hf, page_size=4, num_total_pages=40, prefill_chunk_size=8):
        c = hf.config
        self.model = MLCLlama(hf)
        self.kv = PagedAttentionKVCache(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                                        c.hidden_size // c.num_attention_heads, page_size, num_total_pages,
                                        c.rope_parameters["rope_theta"])
        self.prefill_chunk_size = prefill_chunk_size
        self.running = []            # requests with a sequence in the cache, in admission order
        self.recycling = {}          # seq_id -> committed tokens of a finished request kept for reuse
        self.finished = []
        self.next_seq_id = 0
        self.step_infos = []

    def _committed_tokens(self, seq_id):
        for r in self.running:
            if r.seq_id == seq_id:
                return r.tokens[: r.num_committed]
        return self.recycling[seq_id]

    def admit(self, req):
        """prefix_cache.cc InsertSequence: reuse a recycling sequence, fork an active one, or add a new one."""
        best = (0, None)
        for sid in [r.seq_id for r in self.running] + list(self.recycling):
            toks = self._committed_tokens(sid)
            m = 0
            while m < min(len(toks), len(req.prompt)) and toks[m] == req.prompt[m]:
                m += 1
            if m > best[0]:
                best = (m, sid)
        matched_offset, matched_seq = best
        if matched_offset == len(req.prompt):
            matched_offset -= 1          # roll back the last token to activate prefill
        if matched_offset == 0:
            req.seq_id = self.next_seq_id
            self.next_seq_id += 1
            self.kv.AddSequence(req.seq_id)
        elif matched_seq in self.recycling:
            length = len(self.recycling.pop(matched_seq))
            self.kv.PopN(matched_seq, length - matched_offset)
            req.seq_id = matched_seq
            req.forked_from = ("recycled", matched_seq, matched_offset)
        else:
            req.seq_id = self.next_seq_id
            self.next_seq_id += 1
            self.kv.ForkSequence(matched_seq, req.seq_id, matched_offset)
            req.forked_from = ("fork", matched_seq, matched_offset)
        req.num_committed = matched_offset
        self.running.append(req)

    def step(self):
        decodes = [r for r in self.running if r.num_committed == len(r.tokens) - 1 and r.num_committed >= len(r.prompt)]
        prefills = [r for r in self.running if r.num_committed < len(r.prompt)]
        batch = [(r, 1) for r in decodes]
        budget = self.prefill_chunk_size - len(decodes)
        for r in prefills:
            if budget <= 0:
                break
            L = min(budget, len(r.prompt) - r.num_committed)
            batch.append((r, L))
            budget -= L
        if not batch:
            return
        seq_ids = [r.seq_id for r, _ in batch]
        lengths = [L for _, L in batch]
        input_ids = torch.tensor([t for r, L in batch for t in r.tokens[r.num_committed: r.num_committed + L]])
        self.kv.BeginForward(seq_ids, lengths)
        hidden = self.model.batch_forward_hidden(input_ids, self.kv)
        self.kv.EndForward()
        self.step_infos.append(self.kv.last_forward_info)
        logits_all = self.model.get_logits(hidden)
        logit_positions = torch.cumsum(torch.tensor(lengths), 0) - 1
        logits_last = logits_all[logit_positions]                  # batch_prefill's logit_positions
        off = 0
        for i, (r, L) in enumerate(batch):
            for j in range(L):
                r.recorded[r.num_committed + j] = logits_all[off + j].clone()
            off += L
            r.num_committed += L
            if r.num_committed == len(r.tokens):
                r.tokens.append(int(logits_last[i].argmax()))
                r.generated += 1
        for r, _ in batch:
            if r.generated >= r.max_new_tokens:
                self.running.remove(r)
                self.finished.append(r)
                if r.rid in ("R2",):                # kept for reuse (lazy recycle)
                    self.recycling[r.seq_id] = r.tokens[: r.num_committed]
                else:
                    self.kv.RemoveSequence(r.seq_id)


def main():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.2,
                         tie_word_embeddings=False, attn_implementation="eager")
    hf = LlamaForCausalLM(config).eval()

    with torch.no_grad():
        # The hand-written reference agrees with transformers' own forward.
        probe = torch.randint(0, 64, (13,)).tolist()
        ref = reference_logits(hf, probe)
        hf_logits = hf(torch.tensor([probe])).logits[0]
        assert torch.allclose(ref, hf_logits, atol=1e-4), (ref - hf_logits).abs().max()

        g = torch.Generator().manual_seed(1)
        rand = lambda n: torch.randint(0, 64, (n,), generator=g).tolist()
        p0 = rand(11)
        p2 = rand(9)
        p1 = p0[:7] + rand(6)                 # shares 7 tokens with R0: fork mid-page
        p5 = rand(10)
        reqs = {
            "R0": Request("R0", p0, 8, 0),
            "R2": Request("R2", p2, 2, 0),
            "R1": Request("R1", p1, 7, 3),
            "R5": Request("R5", p5, 4, 9),
        }
        engine = Engine(hf)
        pending = sorted(reqs.values(), key=lambda r: r.arrive_step)
        late = {}
        for step in range(40):
            for r in [r for r in pending if r.arrive_step == step]:
                engine.admit(r)
                pending.remove(r)
            # R3 follows R1's prompt for 9 tokens (fork of a fork: a third block level);
            # R4 repeats R2's prompt after R2 finished (reuse of the recycled sequence).
            if "R3" not in late and reqs["R1"].num_committed >= 9:
                late["R3"] = Request("R3", reqs["R1"].tokens[:9] + rand(3), 5, step)
                engine.admit(late["R3"])
            if "R4" not in late and engine.recycling:
                late["R4"] = Request("R4", list(p2), 3, step)
                engine.admit(late["R4"])
            engine.step()
            if not engine.running and not pending and len(late) == 2:
                break
        reqs.update(late)
        assert not engine.running and len(engine.finished) == 6

        infos = engine.step_infos
        assert any(i["num_depths"] == 2 and i["trailing"] for i in infos)                   # block past depth 2
        assert any(i["append_before_attn"] and i["num_depths"] == 2 for i in infos)          # decode over shared prefix
        assert any(not i["append_before_attn"] and i["entries_per_depth"][0] < i["batch_size"]
                   for i in infos)                                                     # coalesced shared prefix
        assert len(engine.kv.free_page_ids_) == engine.kv.num_total_pages_              # every page given back
        assert len(engine.kv.free_block_idx_) == len(engine.kv.global_block_pool_)
        assert reqs["R1"].forked_from == ("fork", reqs["R0"].seq_id, 7)
        assert reqs["R3"].forked_from[0] == "fork" and reqs["R3"].forked_from[2] == 9
        assert reqs["R4"].forked_from == ("recycled", reqs["R2"].seq_id, 8)

        worst = 0.0
        for name, r in reqs.items():
            ref = reference_logits(hf, r.tokens[:-1])
            positions = sorted(r.recorded)
            start = r.forked_from[2] if r.forked_from else 0
            assert positions == list(range(start, len(r.tokens) - 1)), (name, positions)
            got = torch.stack([r.recorded[p] for p in positions])
            err = (got - ref[positions]).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-4, (name, err)
            ref_next = ref[len(r.prompt) - 1:].argmax(-1).tolist()
            assert r.tokens[len(r.prompt):] == ref_next, (name, r.tokens[len(r.prompt):], ref_next)
            print(f"{name}: prompt {len(r.prompt)}, generated {r.tokens[len(r.prompt):]}, "
                  f"prefill from {start} ({r.forked_from}), max |logit diff| {err:.2e}")
        print(f"{len(infos)} engine steps; depths per step {[i['num_depths'] for i in infos]}")
        print(f"OK: every engine logit matches each request run alone (max diff {worst:.2e})")


if __name__ == "__main__":
    main()
