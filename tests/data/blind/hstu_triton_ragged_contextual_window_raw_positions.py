# Citation: meta-recsys/generative-recommenders commit a01d3b4 ("Fix contextual_seq_len and unit
#   tests", D66683060, 2024-12-04).  A different, later fix than 2b402a7 / #130: by then the
#   contextual length did reach the kernel; this commit fixes how the kernel masks with it.
# Upstream: generative_recommenders/ops/triton/triton_ragged_hstu_attention.py
#   _ragged_hstu_attn_fwd_one_block (the per-tile keep mask, named `invalid_mask` upstream),
#   _ragged_hstu_attn_fwd_compute (the per-row-block [low, high) key range),
#   triton_ragged_attention_fwd (launch).  Triton kernels are written here as plain torch loops
#   over the same BLOCK_M x BLOCK_N tiles, with the same index arithmetic.
# Bug: with contextual tokens (user features prepended to each jagged history) the mask used raw
#   row/column indices: the max_attn_len window and the target clamp counted the C contextual
#   tokens as C separate positions, and contextual rows were recognised by a raw index test, so
#   history rows near the window edge lost (or kept) contextual keys depending on how many
#   contextual slots there were; contextual row blocks also kept a low > 0.
# Fix: shift positions by CONTEXTUAL_SEQ_LEN - 1 (all contextual tokens collapse to position 0),
#   clamp targets at max_ids = seq_len - C + 1 - n_targets, let position-0 rows see every
#   non-target key, and start contextual row blocks at low = 0.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

BLOCK_M = 4
BLOCK_N = 4


def fast_dividef(a, b):
    return a / b


def _ragged_hstu_attn_fwd_one_block(
    start_n,
    seq_len,
    offs_m,
    offs_n,
    q,
    k_blk,
    v_blk,
    n_targets,
    alpha,
    MAX_SEQ_LEN,
    MAX_ATTN_LEN,
    INVALID_MASK_TYPE,
    HAS_MULTIPLE_TARGETS,
    CONTEXTUAL_SEQ_LEN,
):
    qk = (q @ k_blk.T) * alpha
    invalid_mask = offs_m[:, None] == offs_n[None, :]
    if not FIXED:
        if HAS_MULTIPLE_TARGETS:
            if INVALID_MASK_TYPE == "lower_triangular":
                offs_m = torch.where(offs_m < seq_len - n_targets, offs_m, seq_len - n_targets)
                offs_n = torch.where(offs_n < seq_len - n_targets, offs_n, seq_len - n_targets)
        offs_n_minus_m = offs_n[None, :] - offs_m[:, None]
        if MAX_ATTN_LEN > 0:
            if INVALID_MASK_TYPE == "lower_triangular":
                invalid_mask = invalid_mask | (
                    (offs_n_minus_m < 0) & (offs_n_minus_m >= -MAX_ATTN_LEN)
                )
        else:
            if INVALID_MASK_TYPE == "lower_triangular":
                invalid_mask = invalid_mask | (offs_n_minus_m < 0)
        if CONTEXTUAL_SEQ_LEN > 0:
            if INVALID_MASK_TYPE == "lower_triangular":
                row_filter = offs_m < CONTEXTUAL_SEQ_LEN
                if HAS_MULTIPLE_TARGETS:
                    col_filter = offs_n < seq_len - n_targets
                else:
                    col_filter = offs_n < seq_len
                invalid_mask = invalid_mask | (row_filter[:, None] & col_filter[None, :])
    else:
        max_ids = seq_len
        if CONTEXTUAL_SEQ_LEN > 0:
            offs_m = offs_m - CONTEXTUAL_SEQ_LEN + 1
            offs_m = torch.where(offs_m > 0, offs_m, 0)
            offs_n = offs_n - CONTEXTUAL_SEQ_LEN + 1
            offs_n = torch.where(offs_n > 0, offs_n, 0)
            max_ids = max_ids - CONTEXTUAL_SEQ_LEN + 1
        if HAS_MULTIPLE_TARGETS:
            max_ids = max_ids - n_targets
            offs_m = torch.where(offs_m < max_ids, offs_m, max_ids)
            offs_n = torch.where(offs_n < max_ids, offs_n, max_ids)
        offs_n_minus_m = offs_n[None, :] - offs_m[:, None]
        if MAX_ATTN_LEN > 0:
            if INVALID_MASK_TYPE == "lower_triangular":
                invalid_mask = invalid_mask | (
                    (offs_n_minus_m < 0) & (offs_n_minus_m >= -MAX_ATTN_LEN)
                )
        else:
            if INVALID_MASK_TYPE == "lower_triangular":
                invalid_mask = invalid_mask | (offs_n_minus_m < 0)
        if CONTEXTUAL_SEQ_LEN > 0:
            invalid_mask = invalid_mask | (
                (offs_m[:, None] == 0) & (offs_n[None, :] < max_ids)
            )
    silu = fast_dividef(qk, 1.0 + torch.exp(-qk)) * (1.0 / MAX_SEQ_LEN)
    silu = torch.where(invalid_mask, silu, torch.zeros_like(silu))
    return silu @ v_blk


def _load_rows(x, start, n, seq_len):
    # tl.make_block_ptr + boundary_check + padding_option="zero"
    idx = torch.arange(start, start + n)
    ok = (idx >= 0) & (idx < seq_len)
    out = torch.zeros(n, x.shape[-1], dtype=x.dtype)
    out[ok] = x[idx[ok]]
    return out


def _ragged_hstu_attn_fwd_compute(
    Q, K, V, seq_offsets, num_targets, Out, alpha, MAX_SEQ_LEN, off_z, off_h, pid,
    INVALID_MASK_TYPE, HAS_MULTIPLE_TARGETS, MAX_ATTN_LEN, CONTEXTUAL_SEQ_LEN,
):
    seq_start = int(seq_offsets[off_z])
    seq_end = int(seq_offsets[off_z + 1])
    seq_len = seq_end - seq_start
    start_m = pid * BLOCK_M
    if start_m < seq_len:
        n_targets = int(num_targets[off_z]) if HAS_MULTIPLE_TARGETS else None
        offs_m = start_m + torch.arange(0, BLOCK_M)
        offs_n = torch.arange(0, BLOCK_N)
        q_seq = Q[seq_start:seq_end, off_h]
        k_seq = K[seq_start:seq_end, off_h]
        v_seq = V[seq_start:seq_end, off_h]
        q = _load_rows(q_seq, start_m, BLOCK_M, seq_len)
        acc = torch.zeros(BLOCK_M, V.shape[-1])
        if INVALID_MASK_TYPE == "lower_triangular":
            if HAS_MULTIPLE_TARGETS:
                if MAX_ATTN_LEN > 0:
                    if not FIXED:
                        start_m_index = (
                            seq_len - n_targets if start_m > seq_len - n_targets else start_m
                        )
                        low = start_m_index - MAX_ATTN_LEN
                    else:
                        if start_m > seq_len - n_targets:
                            low = seq_len - n_targets - MAX_ATTN_LEN
                        else:
                            low = start_m - MAX_ATTN_LEN
                    low = low if low > 0 else 0
                else:
                    low = 0
                uih_end = (seq_len - n_targets + BLOCK_N - 1) // BLOCK_N * BLOCK_N
                if uih_end < start_m:
                    high = seq_len - n_targets
                else:
                    high = start_m + BLOCK_M
                if CONTEXTUAL_SEQ_LEN > 0:
                    if start_m < CONTEXTUAL_SEQ_LEN:
                        if FIXED:
                            low = 0
                        high = seq_len - n_targets
            else:
                if MAX_ATTN_LEN > 0:
                    low = start_m - MAX_ATTN_LEN
                    low = low if low > 0 else 0
                else:
                    low = 0
                high = start_m + BLOCK_M
                if CONTEXTUAL_SEQ_LEN > 0:
                    if start_m < CONTEXTUAL_SEQ_LEN:
                        if FIXED:
                            low = 0
                        high = seq_len
        for start_n in range(low, high, BLOCK_N):
            cur_offs_n = offs_n + start_n
            acc += _ragged_hstu_attn_fwd_one_block(
                start_n=start_n,
                seq_len=seq_len,
                offs_m=offs_m,
                offs_n=cur_offs_n,
                q=q,
                k_blk=_load_rows(k_seq, start_n, BLOCK_N, seq_len),
                v_blk=_load_rows(v_seq, start_n, BLOCK_N, seq_len),
                n_targets=n_targets,
                alpha=alpha,
                MAX_SEQ_LEN=MAX_SEQ_LEN,
                MAX_ATTN_LEN=MAX_ATTN_LEN,
                INVALID_MASK_TYPE=INVALID_MASK_TYPE,
                HAS_MULTIPLE_TARGETS=HAS_MULTIPLE_TARGETS,
                CONTEXTUAL_SEQ_LEN=CONTEXTUAL_SEQ_LEN,
            )
        if HAS_MULTIPLE_TARGETS and INVALID_MASK_TYPE == "lower_triangular":
            if uih_end < start_m:
                low_delta = start_m
                high_delta = start_m + BLOCK_M
                for start_delta in range(low_delta, high_delta, BLOCK_N):
                    cur_offs_n = offs_n + start_delta
                    acc += _ragged_hstu_attn_fwd_one_block(
                        start_n=start_delta,
                        seq_len=seq_len,
                        offs_m=offs_m,
                        offs_n=cur_offs_n,
                        q=q,
                        k_blk=_load_rows(k_seq, start_delta, BLOCK_N, seq_len),
                        v_blk=_load_rows(v_seq, start_delta, BLOCK_N, seq_len),
                        n_targets=n_targets,
                        alpha=alpha,
                        MAX_SEQ_LEN=MAX_SEQ_LEN,
                        MAX_ATTN_LEN=MAX_ATTN_LEN,
                        INVALID_MASK_TYPE=INVALID_MASK_TYPE,
                        HAS_MULTIPLE_TARGETS=HAS_MULTIPLE_TARGETS,
                        CONTEXTUAL_SEQ_LEN=CONTEXTUAL_SEQ_LEN,
                    )
        rows = offs_m[offs_m < seq_len]
        Out[seq_start + rows, off_h] = acc[: rows.numel()]


def triton_ragged_attention_fwd(
    N, alpha, q, k, v, seq_offsets, invalid_attn_mask_type, num_targets,
    attn_bias, seq2_offsets, max_attn_len, contextual_seq_len, sort_by_length_indices,
):
    assert invalid_attn_mask_type in ["lower_triangular", "upper_triangular"]
    Z = seq_offsets.numel() - 1
    L, H, DimQ = q.shape
    out = torch.empty_like(v)
    max_attn_len = max_attn_len or 0
    contextual_seq_len = contextual_seq_len or 0
    has_multiple_targets = num_targets is not None
    n_row_blocks = (N + BLOCK_M - 1) // BLOCK_M
    for off_z in range(Z):          # grid = (cdiv(N, BLOCK_M), Z * H)
        for off_h in range(H):
            for pid in range(n_row_blocks):
                _ragged_hstu_attn_fwd_compute(
                    q, k, v, seq_offsets, num_targets, out, alpha, N, off_z, off_h, pid,
                    INVALID_MASK_TYPE=invalid_attn_mask_type,
                    HAS_MULTIPLE_TARGETS=has_multiple_targets,
                    MAX_ATTN_LEN=max_attn_len,
                    CONTEXTUAL_SEQ_LEN=contextual_seq_len,
                )
    return out


class STULayer(torch.nn.Module):
    """One HSTU layer: uvqk projection, SiLU, ragged pointwise attention, u-gated norm, out proj."""

    def __init__(self, embedding_dim, num_heads, attention_dim, linear_dim):
        super().__init__()
        self.num_heads = num_heads
        self.attention_dim = attention_dim
        self.linear_dim = linear_dim
        self.uvqk = torch.nn.Linear(
            embedding_dim, (linear_dim * 2 + attention_dim * 2) * num_heads, bias=False
        )
        self.out = torch.nn.Linear(linear_dim * num_heads, embedding_dim)
        self.input_norm = torch.nn.LayerNorm(embedding_dim)

    def forward(self, x, x_offsets, max_seq_len, num_targets, max_attn_len, contextual_seq_len):
        h, a, l_ = self.num_heads, self.attention_dim, self.linear_dim
        uvqk = F.silu(self.uvqk(self.input_norm(x)))
        u, v, q, k = torch.split(uvqk, [l_ * h, l_ * h, a * h, a * h], dim=1)
        attn = triton_ragged_attention_fwd(
            N=max_seq_len,
            alpha=1.0 / a ** 0.5,
            q=q.view(-1, h, a),
            k=k.view(-1, h, a),
            v=v.view(-1, h, l_),
            seq_offsets=x_offsets,
            invalid_attn_mask_type="lower_triangular",
            num_targets=num_targets,
            attn_bias=None,
            seq2_offsets=None,
            max_attn_len=max_attn_len,
            contextual_seq_len=contextual_seq_len,
            sort_by_length_indices=None,
        ).reshape(-1, h * l_)
        y = u * F.layer_norm(attn, [h * l_])
        return x + self.out(y)


def main():
    torch.manual_seed(0)
    D, H = 16, 2
    contextual_seq_len = 3   # user features prepended to each history
    max_attn_len = 4
    # jagged batch: [contextual(3) | user history | candidates(num_targets)]
    seq_lengths = torch.tensor([13, 9, 11])
    num_targets = torch.tensor([2, 1, 3])
    x_offsets = torch.cat([torch.zeros(1, dtype=torch.long), seq_lengths.cumsum(0)])
    max_seq_len = int(seq_lengths.max())
    total = int(x_offsets[-1])

    item_emb = torch.nn.Embedding(50, D)
    ids = torch.randint(1, 50, (total,))
    x = item_emb(ids)

    layers = torch.nn.ModuleList([STULayer(D, H, 8, 8) for _ in range(2)])
    with torch.no_grad():
        for layer in layers:
            x = layer(x, x_offsets, max_seq_len, num_targets, max_attn_len, contextual_seq_len)

    # next-item logits at each candidate row, softmax over the catalogue
    tgt_rows, tgt_ids = [], []
    for z in range(len(seq_lengths)):
        end = int(x_offsets[z + 1])
        nt = int(num_targets[z])
        tgt_rows.append(x[end - nt:end])
        tgt_ids.append(ids[end - nt:end])
    logits = torch.cat(tgt_rows) @ item_emb.weight.T / D ** 0.5
    labels = torch.cat(tgt_ids)
    scores = logits.gather(1, labels[:, None]).squeeze(1)
    loss = F.cross_entropy(logits, labels)
    torch.set_printoptions(precision=5, sci_mode=False)
    print("candidate scores:", scores.detach())
    print("history row norms seq0:", x[:int(seq_lengths[0])].norm(dim=-1).detach())
    print("loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
