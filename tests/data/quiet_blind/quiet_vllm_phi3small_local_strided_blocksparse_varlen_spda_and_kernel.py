# Correct program (quiet batch quiet-r71b).
# Citation: vllm-project/vllm vllm/attention/ops/blocksparse_attention/utils.py @00e3ddc51d79bc6f01186f8e87f7cde8a042502f
#   (dense_to_crow_col, get_head_sliding_step, get_sparse_attn_mask, binary_mask_to_bias) and
#   interface.py + blocksparse_attention_kernel.py @0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f (LocalStridedBlockSparseAttn:
#   get_attn_pattern with active_head_range, transpose_and_pad / transpose_and_unpad, spda;
#   blocksparse_flash_attn_varlen_fwd / _fwd_kernel_batch_inference, here as a torch loop over the same CSR layout).
#   The block-sparse pattern is Phi-3-small's (local blocks plus vertical strides shifted per head).
# Masking: block (qb, kb) is kept when kb <= qb and (qb - kb < local_blocks or (kb + h * head_sliding_step + 1) %
#   vert_stride == 0); the SDPA path expands it with kron to tokens, multiplies by a causal tril and turns it into a
#   -inf bias, sliced [:maxlen, :maxlen] for a batch of packed prompts padded per sequence; the kernel path walks the
#   CSR (crow, col) row of block q_pbid = (past_len + q_start_sid) // BLOCK_M and applies the causal compare
#   offs_m + past_len >= start_n + offs_n on the last key block, for packed prefill and for one-token decode.
# Self-check: both paths (and the SDPA path split over two tensor-parallel head ranges) against a double loop over
#   each sequence's own tokens that applies the block rule and causality token by token.
import math
from functools import lru_cache

import numpy as np
import torch

torch.manual_seed(0)


def cdiv(a, b):                                     # triton.cdiv
    return (a + b - 1) // b


class csr_matrix:
    def __init__(self, input_array):
        self.shape = input_array.shape
        rows, cols = self.shape
        indices, indptr = [], [0]
        for i in range(rows):
            for j in range(cols):
                if input_array[i, j]:
                    indices.append(j)
            indptr.append(len(indices))
        self.indices = np.array(indices)
        self.indptr = np.array(indptr)


def dense_to_crow_col(x):
    pad = -1
    dim = x.dim()
    if x.dim() == 2:
        x = x[None]
    x = [csr_matrix(xi.bool().cpu().numpy()) for xi in x]
    crows = torch.vstack([torch.from_numpy(xi.indptr) for xi in x])
    cols = [torch.from_numpy(xi.indices) for xi in x]
    max_cols = max(len(xi) for xi in cols)
    cols = torch.vstack([torch.cat([xi, pad + xi.new_zeros(max_cols - xi.shape[0])]) for xi in cols])
    if dim == 2:
        crows, cols = crows[0], cols[0]
    return crows, cols


def binary_mask_to_bias(mask_dense):
    mask_dense = 1 - mask_dense
    mask_dense.masked_fill_(mask_dense.bool(), -torch.inf)
    return mask_dense


def get_head_sliding_step(n_heads, vert_stride, homo_head=False):
    if homo_head:
        return 0
    return max(1, int(vert_stride / n_heads))


@lru_cache
def get_sparse_attn_mask(n_heads, q_len, max_seqlen, dtype, device, block_size=64, local_blocks=4, vert_stride=4,
                         homo_head=True, return_dense=False, dense_mask_type="binary"):
    assert not homo_head
    with torch.no_grad():
        num_blocks = cdiv(max_seqlen, block_size)
        q_pos = torch.arange(num_blocks)[None, :, None]
        k_pos = torch.arange(num_blocks)[None, None]
        head_sliding_step = get_head_sliding_step(n_heads, vert_stride)
        mask_vert_strided = [(torch.arange(num_blocks) + h * head_sliding_step + 1) % vert_stride == 0
                             for h in range(n_heads)]
        mask_vert_strided = torch.vstack(mask_vert_strided).unsqueeze(1)
        block_mask_dense = (((q_pos >= k_pos) & ((q_pos - k_pos < local_blocks) | mask_vert_strided))
                            .to(device).to(dtype))
        num_blocks_q = cdiv(q_len, block_size)
        block_mask_dense_output = block_mask_dense[:, -num_blocks_q:]
    if return_dense:
        mask_dense = torch.kron(block_mask_dense, block_mask_dense.new_ones((block_size, block_size)))
        causal_mask = torch.tril(torch.ones(max_seqlen, max_seqlen)).type_as(mask_dense)[-q_len:]
        mask_dense = mask_dense[..., -q_len:, :max_seqlen] * causal_mask[None]
        if dense_mask_type == "bias":
            mask_dense = binary_mask_to_bias(mask_dense)
        return dense_to_crow_col(block_mask_dense_output), block_mask_dense, mask_dense
    return dense_to_crow_col(block_mask_dense_output), block_mask_dense, None


class LocalStridedBlockSparseAttn(torch.nn.Module):
    def __init__(self, n_heads, max_seqlen, local_blocks, vert_stride, block_size, device=None, dtype=None,
                 homo_head=False, active_head_range=None, use_spda=True):
        super().__init__()
        self.n_heads = n_heads
        self.max_seqlen = max_seqlen
        self.local_blocks = local_blocks
        self.vert_stride = vert_stride
        self.use_spda = use_spda
        self.dtype = dtype
        self.device = torch.device(device or "cpu")
        self.block_size = block_size
        self.homo_head = homo_head
        self.active_head_range = active_head_range
        self.head_sliding_step = get_head_sliding_step(n_heads, vert_stride, homo_head)
        self.sparse_layout, sparse_pattern, self.dense_attn_mask = self.get_attn_pattern(dtype, self.device)

    def get_attn_pattern(self, dtype, device):
        sparse_layout, sparse_pattern, dense_attn_mask = get_sparse_attn_mask(
            self.n_heads, self.max_seqlen, self.max_seqlen, dtype, device, block_size=self.block_size,
            local_blocks=self.local_blocks, vert_stride=self.vert_stride, homo_head=self.homo_head,
            return_dense=self.use_spda, dense_mask_type="bias")
        if (not self.homo_head) and (self.active_head_range is not None):
            h_start, h_end = self.active_head_range
            sparse_layout = tuple(x[h_start:h_end] for x in sparse_layout)
            if self.use_spda:
                dense_attn_mask = dense_attn_mask[h_start:h_end]
        return sparse_layout, sparse_pattern, dense_attn_mask

    @staticmethod
    def transpose_and_pad(x, cu_seqlens, maxlen, head_repeats=1):
        # upstream allocates with new_empty; zeros here keep the padded tail deterministic
        x_padded = x.new_zeros(len(cu_seqlens) - 1, x.size(1), head_repeats, maxlen, x.size(2))
        cu_seqlens = cu_seqlens.cpu()
        for i, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
            x_padded[i, :, :, : e - s].copy_(x[s:e].transpose(0, 1).unsqueeze(1))
        return x_padded.flatten(1, 2)

    @staticmethod
    def transpose_and_unpad(x_padded, cu_seqlens):
        cu_seqlens = cu_seqlens.cpu()
        x = x_padded.new_empty(cu_seqlens[-1], x_padded.size(1), x_padded.size(3))
        for i, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
            x[s:e].copy_(x_padded[i, :, : e - s].transpose(0, 1))
        return x

    def spda(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None):
        assert cu_seqlens_q is None or (cu_seqlens_q == cu_seqlens_k).all(), "Can only handle prompt with SPDA."
        assert q.size(0) == k.size(0), "can only handle prompt with SPDA."
        q_k_ratio = q.size(1) // k.size(1)
        sm_scale = sm_scale or 1.0 / math.sqrt(q.size(-1))
        cu_seqlens = cu_seqlens_k.cpu()
        maxlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
        attn_mask = self.dense_attn_mask[None, :, :maxlen, :maxlen]
        q2 = self.transpose_and_pad(q, cu_seqlens, maxlen, 1)
        k2, v2 = [self.transpose_and_pad(x, cu_seqlens, maxlen, q_k_ratio) for x in [k, v]]
        spda_output = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=attn_mask, scale=sm_scale)
        return self.transpose_and_unpad(spda_output, cu_seqlens)

    def varlen_attn(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None):
        sm_scale = sm_scale or 1.0 / math.sqrt(q.size(-1))
        return blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, self.sparse_layout,
                                                 block_size=self.block_size, max_seqlen=self.max_seqlen)

    def forward(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None):
        if self.use_spda:
            return self.spda(q, k, v, cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, sm_scale=sm_scale)
        return self.varlen_attn(q, k, v, cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, sm_scale=sm_scale)


def blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout, *,
                                      block_size=64, q_block_size=None, max_seqlen=None):
    _, n_heads, head_size = q.shape
    batch_size = cu_seqlens_k.size(0) - 1
    q_block_size = q_block_size or block_size
    q_k_ratio = q.size(1) // k.size(1)
    if cu_seqlens_q is None:
        if q.size(0) == batch_size:
            cu_seqlens_q = torch.arange(0, batch_size + 1, dtype=cu_seqlens_k.dtype)
        else:
            cu_seqlens_q = cu_seqlens_k
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    k_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    assert torch.logical_or(q_lens == 1, k_lens == q_lens).all()
    assert k_lens.max() <= max_seqlen
    n_blocks = (q_lens + q_block_size - 1) // q_block_size
    q_batch_ids = [i for i, n in enumerate(n_blocks) for _ in range(n)]
    q_start_sids = [i * q_block_size for n in n_blocks for i in range(n)]
    out = q.new_zeros(q.shape)
    layout_crow_indices, layout_col_indices = sparse_layout
    BLOCK_M, BLOCK_N = q_block_size, block_size
    # one program per (q block, head), as the grid (len(q_start_sids), n_heads, 1)
    for off_zm in range(len(q_start_sids)):
        for off_h in range(n_heads):
            off_h_for_kv = off_h // q_k_ratio
            off_z, q_start_sid = q_batch_ids[off_zm], q_start_sids[off_zm]
            start_m = q_start_sid // BLOCK_M
            offs_m = start_m * BLOCK_M + torch.arange(BLOCK_M)
            offs_n = torch.arange(BLOCK_N)
            q_cu_start = int(cu_seqlens_q[off_z]); q_seqlen = int(cu_seqlens_q[off_z + 1]) - q_cu_start
            k_cu_start = int(cu_seqlens_k[off_z]); k_seqlen = int(cu_seqlens_k[off_z + 1]) - k_cu_start
            past_len = k_seqlen - q_seqlen
            Q = q[q_cu_start:q_cu_start + q_seqlen, off_h]
            K = k[k_cu_start:k_cu_start + k_seqlen, off_h_for_kv]
            V = v[k_cu_start:k_cu_start + k_seqlen, off_h_for_kv]
            q_pbid = (past_len + q_start_sid) // BLOCK_M
            row_ok = offs_m < q_seqlen
            qb = torch.zeros(BLOCK_M, head_size)
            qb[row_ok] = Q[offs_m[row_ok]]
            k_block_start = int(layout_crow_indices[off_h, q_pbid])
            k_block_end = int(layout_crow_indices[off_h, q_pbid + 1])
            m_i = torch.full((BLOCK_M,), -float("inf"))
            l_i = torch.zeros(BLOCK_M)
            acc = torch.zeros(BLOCK_M, head_size)
            scale2 = sm_scale * 1.44269504
            for k_block_col_idx in range(k_block_start, k_block_end):
                last = k_block_col_idx == k_block_end - 1
                start_n = int(layout_col_indices[off_h, k_block_col_idx]) * BLOCK_N
                col_ok = offs_n + start_n < k_seqlen
                kb = torch.zeros(BLOCK_N, head_size); vb = torch.zeros(BLOCK_N, head_size)
                kb[col_ok] = K[(start_n + offs_n)[col_ok]]
                vb[col_ok] = V[(start_n + offs_n)[col_ok]]
                qk = (qb @ kb.T) * scale2
                if last:
                    qk = qk + torch.where(offs_m[:, None] + past_len >= (start_n + offs_n[None, :]), 0.0, -float("inf"))
                m_ij = torch.maximum(m_i, qk.max(1).values)
                p = torch.exp2(qk - m_ij[:, None])
                alpha = torch.exp2(m_i - m_ij)
                acc = acc * alpha[:, None] + p @ vb
                l_i = l_i * alpha + p.sum(1)
                m_i = m_ij
            acc = acc / l_i[:, None]
            out[q_cu_start + offs_m[row_ok], off_h] = acc[row_ok]
    return out


# Phi-3-small style attention: 4 query heads over 2 kv heads, blocks of 4 tokens, 2 local blocks, vertical stride 3
n_heads, n_kv, head_size = 4, 2, 8
block_size, local_blocks, vert_stride, max_seqlen = 4, 2, 3, 32
lens = [13, 24, 6]
cu_seqlens = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)
T = int(cu_seqlens[-1])
q = torch.randn(T, n_heads, head_size)
k = torch.randn(T, n_kv, head_size)
v = torch.randn(T, n_kv, head_size)

step = get_head_sliding_step(n_heads, vert_stride)


def reference(q_rows, positions, k_seq, v_seq, h):
    """double loop: query at absolute position i of one sequence against that sequence's keys."""
    outs = []
    for qi, i in zip(q_rows, positions):
        keys = [j for j in range(i + 1)
                if (i // block_size - j // block_size < local_blocks)
                or ((j // block_size + h * step + 1) % vert_stride == 0)]
        s = torch.stack([qi @ k_seq[j] for j in keys]) / math.sqrt(head_size)
        outs.append((s.softmax(-1)[:, None] * v_seq[keys]).sum(0))
    return torch.stack(outs)


attn_spda = LocalStridedBlockSparseAttn(n_heads, max_seqlen, local_blocks, vert_stride, block_size,
                                        dtype=torch.float32, use_spda=True)
attn_kernel = LocalStridedBlockSparseAttn(n_heads, max_seqlen, local_blocks, vert_stride, block_size,
                                          dtype=torch.float32, use_spda=False)
out_spda = attn_spda(q, k, v, cu_seqlens)
out_kernel = attn_kernel(q, k, v, cu_seqlens)

# tensor parallel: two ranks, each with half the query heads and half the kv heads
tp = []
for rank in range(2):
    hs, he = rank * n_heads // 2, (rank + 1) * n_heads // 2
    ks, ke = rank * n_kv // 2, (rank + 1) * n_kv // 2
    m = LocalStridedBlockSparseAttn(n_heads, max_seqlen, local_blocks, vert_stride, block_size, dtype=torch.float32,
                                    active_head_range=(hs, he), use_spda=True)
    tp.append(m(q[:, hs:he], k[:, ks:ke], v[:, ks:ke], cu_seqlens))
out_tp = torch.cat(tp, dim=1)

for b, n in enumerate(lens):
    s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
    for h in range(n_heads):
        ref = reference(q[s:e, h], range(n), k[s:e, h // (n_heads // n_kv)], v[s:e, h // (n_heads // n_kv)], h)
        assert torch.allclose(out_spda[s:e, h], ref, atol=1e-5), ("spda", b, h)
        assert torch.allclose(out_kernel[s:e, h], ref, atol=1e-5), ("kernel", b, h)
        assert torch.allclose(out_tp[s:e, h], ref, atol=1e-5), ("tp", b, h)

# decode: one new token per sequence, keys = the whole sequence so far (its prompt plus the new token)
new_q = torch.randn(len(lens), n_heads, head_size)
new_k = torch.randn(len(lens), n_kv, head_size)
new_v = torch.randn(len(lens), n_kv, head_size)
k_all, v_all, cu_k = [], [], [0]
for b, n in enumerate(lens):
    s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
    k_all += [k[s:e], new_k[b:b + 1]]
    v_all += [v[s:e], new_v[b:b + 1]]
    cu_k.append(cu_k[-1] + n + 1)
k_all, v_all = torch.cat(k_all), torch.cat(v_all)
cu_k = torch.tensor(cu_k, dtype=torch.int32)
out_dec = attn_kernel(new_q, k_all, v_all, cu_k)
for b, n in enumerate(lens):
    s, e = int(cu_k[b]), int(cu_k[b + 1])
    for h in range(n_heads):
        kv_h = h // (n_heads // n_kv)
        ref = reference(new_q[b:b + 1, h], [n], k_all[s:e, kv_h], v_all[s:e, kv_h], h)
        assert torch.allclose(out_dec[b, h], ref[0], atol=1e-5), ("decode", b, h)

print("ok")
