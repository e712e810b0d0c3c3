"""vllm-flash-attn's vertical-slash sparse kernel ran non-causal: the causal flag never reached it.

Citation: vllm-project/flash-attention#60 (commit e371cc4, cherry-pick of #39),
csrc/flash_attn/flash_api_sparse.cpp ``set_params_fprop_sparse`` / ``mha_fwd_sparse``.

``sparse_attn_func(q, k, v, block_count, block_offset, column_count, column_index, causal=True)`` (the
MInference-style vertical-slash prefill used by vLLM's dual-chunk attention for Qwen2.5-1M) handed
``set_params_fprop`` a hard-coded ``window_size_left = -1, window_size_right = -1``. ``set_params_fprop``
derives ``params.is_causal = window_size_left < 0 && window_size_right == 0``, so ``is_causal`` came out
false and ``run_mha_fwd_sparse`` launched the ``Is_causal = false`` kernel: inside a selected slash block
that straddles the diagonal, and for vertical columns later than the query, the queries attended to
future keys. (The PR reports RULER at 131k going from 2.05% to 84.13% with the fix.)

The fix: ``if (is_causal) { window_size_right = 0; }`` and pass both window sizes through.

This program ports the host side (window sizes -> is_causal -> the kernel's template flag) and the
kernel's two loops (the slash blocks at ``block_offset`` with ``mask.apply_mask<Is_causal>``, then the
gathered vertical columns with ``col_idx_limit``) to torch, with BLOCK_M = kBlockN = 64 and head_dim 128
as the API requires, plus a torch ``convert_vertical_slash_indexes`` fed by MInference's last-64-query
estimate of the vertical and slash indices, for a one-layer prefill of 192 tokens.
"""

import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

BLOCK_M = 64
kBlockN = 64


# ---- csrc/flash_attn/flash_api.cpp: set_params_fprop (the part that reads the window sizes) ---------
class Flash_fwd_params_sparse:
    pass


def set_params_fprop(params, seqlen_q, seqlen_k, softmax_scale, window_size_left, window_size_right):
    params.seqlen_q = seqlen_q
    params.seqlen_k = seqlen_k
    params.scale_softmax = softmax_scale
    params.is_causal = window_size_left < 0 and window_size_right == 0
    if window_size_left < 0 and window_size_right >= 0:
        window_size_left = seqlen_k
    if window_size_left >= 0 and window_size_right < 0:
        window_size_right = seqlen_k
    params.window_size_left = window_size_left
    params.window_size_right = window_size_right


# ---- csrc/flash_attn/flash_api_sparse.cpp ------------------------------------------------------------
def set_params_fprop_sparse(params, seqlen_q, seqlen_k, block_count, block_offset, column_count,
                            column_index, softmax_scale, window_size_left=-1, window_size_right=-1):
    if FIXED:
        set_params_fprop(params, seqlen_q, seqlen_k, softmax_scale, window_size_left, window_size_right)
    else:
        set_params_fprop(params, seqlen_q, seqlen_k, softmax_scale,
                         -1,  # window_size_left
                         -1)  # window_size_right
    params.block_count = block_count
    params.block_offset = block_offset
    params.column_count = column_count
    params.column_index = column_index
    params.NUM_ROWS = block_count.size(2)
    assert params.NUM_ROWS == (seqlen_q + BLOCK_M - 1) // BLOCK_M
    params.NNZ_S = block_offset.size(3)
    params.NNZ_V = column_index.size(3)


def mha_fwd_sparse(q, k, v, block_count, block_offset, column_count, column_index, softmax_scale, is_causal):
    batch_size, seqlen_q, num_heads, head_size = q.shape
    seqlen_k = k.shape[1]
    assert head_size == 128, "run_mha_fwd_sparse only supports headdim=128 for now"
    if seqlen_q == 1:
        is_causal = False
    params = Flash_fwd_params_sparse()
    if FIXED:
        window_size_left = -1
        window_size_right = -1
        if is_causal:
            window_size_right = 0
        set_params_fprop_sparse(params, seqlen_q, seqlen_k, block_count, block_offset, column_count,
                                column_index, softmax_scale, window_size_left, window_size_right)
    else:
        set_params_fprop_sparse(params, seqlen_q, seqlen_k, block_count, block_offset, column_count,
                                column_index, softmax_scale)
    # run_mha_fwd_sparse: BOOL_SWITCH(params.is_causal, Is_causal, ...)
    return run_mha_fwd_sparse_(q, k, v, params, Is_causal=params.is_causal)


# ---- csrc/flash_attn/src/flash_fwd_sparse_kernel.h ---------------------------------------------------
def run_mha_fwd_sparse_(q, k, v, params, Is_causal):
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    out = torch.zeros_like(q)
    for bidb in range(b):
        for bidh in range(h):
            for m_block in range(params.NUM_ROWS):
                rows = torch.arange(m_block * BLOCK_M, min((m_block + 1) * BLOCK_M, sq))
                qt = q[bidb, rows, bidh] * params.scale_softmax
                row_max = torch.full((len(rows),), -math.inf)
                row_sum = torch.zeros(len(rows))
                acc_o = torch.zeros(len(rows), v.shape[-1])

                def softmax_rescale_o(acc_s, vt):
                    nonlocal row_max, row_sum, acc_o
                    new_max = torch.maximum(row_max, acc_s.max(-1).values)
                    m = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
                    p = torch.exp(acc_s - m[:, None])
                    corr = torch.exp(row_max - m)
                    row_sum = row_sum * corr + p.sum(-1)
                    acc_o = acc_o * corr[:, None] + p @ vt
                    row_max = new_max

                # slash blocks: start_n = blks_ptr[block_index]
                num_blks = int(params.block_count[bidb, bidh, m_block])
                for block_index in range(num_blks - 1, -1, -1):
                    start_n = int(params.block_offset[bidb, bidh, m_block, block_index])
                    cols = torch.arange(start_n, start_n + kBlockN)
                    valid = cols < sk
                    cols_c = cols.clamp(max=sk - 1)
                    acc_s = qt @ k[bidb, cols_c, bidh // (h // k.shape[2])].T
                    # mask.apply_mask<Is_causal, Is_even_MN>
                    col_idx_limit = torch.full((len(rows),), sk)
                    if Is_causal:
                        col_idx_limit = torch.clamp(rows + 1 + sk - sq, max=sk)
                    acc_s = acc_s.masked_fill(~valid[None, :] | (cols[None, :] >= col_idx_limit[:, None]), -math.inf)
                    softmax_rescale_o(acc_s, v[bidb, cols_c, bidh // (h // k.shape[2])])
                # vertical columns: token_idx = cols_ptr[n * kBlockN + j]
                num_cols = int(params.column_count[bidb, bidh, m_block])
                for n in range((num_cols + kBlockN - 1) // kBlockN):
                    idx = torch.arange(n * kBlockN, (n + 1) * kBlockN)
                    in_range = idx < num_cols
                    token_idx = params.column_index[bidb, bidh, m_block, idx.clamp(max=params.NNZ_V - 1)].long()
                    token_idx = torch.where(in_range, token_idx, torch.zeros_like(token_idx))
                    acc_s = qt @ k[bidb, token_idx, bidh // (h // k.shape[2])].T
                    col_idx_limit = (torch.clamp(rows + 1 + sk - sq, max=sk) if Is_causal
                                     else torch.full((len(rows),), sk))
                    drop = ~in_range[None, :] | (token_idx[None, :] >= col_idx_limit[:, None])
                    acc_s = acc_s.masked_fill(drop, -math.inf)
                    softmax_rescale_o(acc_s, v[bidb, token_idx, bidh // (h // k.shape[2])])
                inv = torch.where(row_sum == 0, torch.ones_like(row_sum), 1.0 / row_sum)
                out[bidb, rows, bidh] = acc_o * inv[:, None]
    return out


# ---- vllm_flash_attn/flash_attn_interface.py ---------------------------------------------------------
def sparse_attn_func(q, k, v, block_count, block_offset, column_count, column_index,
                     softmax_scale=None, causal=False):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    return mha_fwd_sparse(q, k, v, block_count, block_offset, column_count, column_index, softmax_scale, causal)


# ---- vertical-slash index estimate and conversion (MInference's pattern) -----------------------------
def vertical_slash_indexes(q, k, vertical_size, slash_size, last_q=64):
    # q, k: (seqlen, head_dim) of one head; estimate with the last 64 queries under a causal mask
    s = q.shape[0]
    qk = q[-last_q:] @ k.T / math.sqrt(q.shape[-1])
    arange = torch.arange(last_q)
    causal = arange[:, None] + (s - last_q) >= torch.arange(s)[None, :]
    qk = torch.softmax(qk.masked_fill(~causal, -math.inf), dim=-1)
    vertical = qk.sum(-2)
    vertical[:30] = math.inf  # sink columns always kept
    vertical_topk = torch.topk(vertical, vertical_size, -1).indices
    # slash: sum along each diagonal offset (s - 1 - col of the last row)
    slash = torch.zeros(s)
    for i in range(last_q):
        row = s - last_q + i
        slash[: row + 1] += qk[i, : row + 1].flip(0)
    slash[:64] = math.inf  # the first offsets (the local diagonal band) always kept
    slash_topk = torch.topk(slash, slash_size, -1).indices  # offsets from the diagonal
    return vertical_topk.sort().values, slash_topk.sort().values


def convert_vertical_slash_indexes(seqlen, vertical_indexes, slash_indexes, block_size_M, block_size_N):
    num_rows = (seqlen + block_size_M - 1) // block_size_M
    block_starts, col_lists = [], []
    for m in range(num_rows):
        start_m, end_m = m * block_size_M, min((m + 1) * block_size_M, seqlen)
        covered = torch.zeros(seqlen, dtype=torch.bool)
        starts = []
        ranges = sorted({(max(0, start_m - int(off)), max(0, end_m - int(off))) for off in slash_indexes
                         if end_m - int(off) > 0})
        merged = []
        for lo, hi in ranges:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            n = lo
            while n < hi:
                starts.append(n)
                covered[n:n + block_size_N] = True
                n += block_size_N
        cols = [int(c) for c in vertical_indexes if int(c) < end_m and not covered[int(c)]]
        block_starts.append(starts)
        col_lists.append(cols)
    nnz_s = max(1, max(len(x) for x in block_starts))
    nnz_v = max(1, max(len(x) for x in col_lists))
    block_count = torch.tensor([len(x) for x in block_starts], dtype=torch.int32)
    block_offset = torch.zeros(num_rows, nnz_s, dtype=torch.int32)
    column_count = torch.tensor([len(x) for x in col_lists], dtype=torch.int32)
    column_index = torch.zeros(num_rows, nnz_v, dtype=torch.int32)
    for m in range(num_rows):
        block_offset[m, : len(block_starts[m])] = torch.tensor(block_starts[m], dtype=torch.int32)
        column_index[m, : len(col_lists[m])] = torch.tensor(col_lists[m], dtype=torch.int32)
    return block_count, block_offset, column_count, column_index


class Config:
    hidden_size = 256
    num_attention_heads = 2
    num_key_value_heads = 2
    head_dim = 128
    vertical_size = 40
    slash_size = 70


class SparsePrefillAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size)

    def forward(self, hidden_states):
        c = self.config
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, c.num_attention_heads, c.head_dim)
        k = self.k_proj(hidden_states).view(b, s, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(hidden_states).view(b, s, c.num_key_value_heads, c.head_dim)
        num_rows = (s + BLOCK_M - 1) // BLOCK_M
        per_head = []
        for bi in range(b):
            for hi in range(c.num_attention_heads):
                vi, si = vertical_slash_indexes(q[bi, :, hi], k[bi, :, hi], c.vertical_size, c.slash_size)
                per_head.append(convert_vertical_slash_indexes(s, vi, si, BLOCK_M, kBlockN))
        nnz_s = max(x[1].shape[1] for x in per_head)
        nnz_v = max(x[3].shape[1] for x in per_head)
        block_count = torch.stack([x[0] for x in per_head]).view(b, c.num_attention_heads, num_rows)
        column_count = torch.stack([x[2] for x in per_head]).view(b, c.num_attention_heads, num_rows)
        block_offset = torch.stack([nn.functional.pad(x[1], (0, nnz_s - x[1].shape[1])) for x in per_head])
        column_index = torch.stack([nn.functional.pad(x[3], (0, nnz_v - x[3].shape[1])) for x in per_head])
        block_offset = block_offset.view(b, c.num_attention_heads, num_rows, nnz_s)
        column_index = column_index.view(b, c.num_attention_heads, num_rows, nnz_v)
        out = sparse_attn_func(q, k, v, block_count, block_offset, column_count, column_index, causal=True)
        return self.o_proj(out.reshape(b, s, -1))


def main():
    torch.manual_seed(0)
    config = Config()
    attn = SparsePrefillAttention(config)
    hidden_states = torch.randn(1, 192, config.hidden_size)
    with torch.no_grad():
        out = attn(hidden_states)
    print("prefill output shape:", tuple(out.shape))
    print(f"token 0 output[:4]: {[round(x, 4) for x in out[0, 0, :4].tolist()]}")
    print(f"token 100 output[:4]: {[round(x, 4) for x in out[0, 100, :4].tolist()]}")
    print(f"mean |output|: {out.abs().mean().item():.6f}")


if __name__ == "__main__":
    main()
