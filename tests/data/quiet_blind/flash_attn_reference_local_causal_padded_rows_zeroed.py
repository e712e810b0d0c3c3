"""Padded, causal, sliding-window attention as flash-attention's reference implementation computes it.

Follows Dao-AILab/flash-attention tests/test_flash_attn.py (construct_local_mask, attention_ref), the reference
that the CUDA kernel is tested against. q has seqlen_q rows, k/v seqlen_k rows, each sample has its own real
lengths (query_padding_mask, key_padding_mask). Causal is bottom-right aligned to the REAL lengths: query i may see
key j iff i + sk - sq - window_left <= j <= i + sk - sq (window_size = (window_left, 0)). When a sample has more
queries than keys, its first queries see no key at all: softmax gives NaN there, and the project then zeroes those
rows (`masked_fill(torch.all(local_mask, -1, keepdim=True), 0.0)`), zeroes padded query rows, and zeroes padded
outputs, so no NaN reaches the output or dV.
"""
import math

import torch


def construct_local_mask(seqlen_q, seqlen_k, window_size=(-1, -1), query_padding_mask=None,
                         key_padding_mask=None):
    """True where the key is NOT allowed; [B, 1, seqlen_q, seqlen_k] when padding masks are given."""
    row_idx = torch.arange(seqlen_q, dtype=torch.long).view(-1, 1)
    col_idx = torch.arange(seqlen_k, dtype=torch.long)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).view(-1, 1, 1, 1)
    if window_size[0] < 0:
        return col_idx > row_idx + sk - sq + window_size[1]
    sk = torch.full_like(col_idx, seqlen_k) if key_padding_mask is None else sk
    return torch.logical_or(
        col_idx > torch.minimum(row_idx + sk - sq + window_size[1], sk),
        col_idx < row_idx + sk - sq - window_size[0],
    )


def attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, causal=False, window_size=(-1, -1)):
    """q: (b, sq, h, d); k, v: (b, sk, h, d). Returns output (b, sq, h, d) and attention (b, h, sq, sk)."""
    if causal:
        window_size = (window_size[0], 0)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    d = q.shape[-1]
    scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(d), k)
    if key_padding_mask is not None:
        scores.masked_fill_(~key_padding_mask[:, None, None, :], float("-inf"))
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = construct_local_mask(seqlen_q, seqlen_k, window_size, query_padding_mask, key_padding_mask)
        scores.masked_fill_(local_mask, float("-inf"))
    attention = torch.softmax(scores, dim=-1)
    # Some rows might be completely masked out so we fill them with zero instead of NaN
    if window_size[0] >= 0 or window_size[1] >= 0:
        attention = attention.masked_fill(torch.all(local_mask, dim=-1, keepdim=True), 0.0)
    # mask padded query rows so the attention matrix has no NaN (it would reach dV)
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    output = torch.einsum("bhts,bshd->bthd", attention, v)
    if query_padding_mask is not None:
        output.masked_fill_(~query_padding_mask[:, :, None, None], 0.0)
    return output, attention


def loop_reference(q, k, v, sq, sk, window_left):
    """One sample cropped to its real lengths; double loop over absolute positions."""
    out = torch.zeros(sq, q.shape[1], q.shape[2])
    for i in range(sq):
        allowed = [j for j in range(sk) if i + sk - sq - window_left <= j <= i + sk - sq]
        if not allowed:
            continue  # no key in reach: the row is defined as zero
        idx = torch.tensor(allowed)
        s = torch.einsum("hd,shd->hs", q[i] / math.sqrt(q.shape[-1]), k[idx])
        out[i] = torch.einsum("hs,shd->hd", s.softmax(-1), v[idx])
    return out


def main():
    torch.manual_seed(0)
    b, seqlen_q, seqlen_k, h, d, window_left = 3, 6, 8, 2, 8, 3
    q_lens, k_lens = torch.tensor([6, 6, 3]), torch.tensor([8, 4, 5])
    query_padding_mask = torch.arange(seqlen_q)[None] < q_lens[:, None]
    key_padding_mask = torch.arange(seqlen_k)[None] < k_lens[:, None]
    q = torch.randn(b, seqlen_q, h, d, requires_grad=True)
    k = torch.randn(b, seqlen_k, h, d, requires_grad=True)
    v = torch.randn(b, seqlen_k, h, d, requires_grad=True)
    out, attn = attention_ref(q, k, v, query_padding_mask, key_padding_mask, causal=True,
                              window_size=(window_left, -1))
    out.sum().backward()
    assert not torch.isnan(out).any() and not torch.isnan(v.grad).any() and not torch.isnan(q.grad).any()
    with torch.no_grad():
        for i in range(b):
            sq, sk = int(q_lens[i]), int(k_lens[i])
            ref = loop_reference(q[i, :sq], k[i, :sk], v[i, :sk], sq, sk, window_left)
            assert torch.allclose(out[i, :sq], ref, atol=1e-5), i
    # sample 1 has 6 queries and 4 keys: its first two queries reach no key
    attn = attn.detach()
    assert float(attn[1, :, :2].abs().sum()) == 0.0
    print(f"out {tuple(out.shape)} zero rows {int((attn.sum(-1) == 0).sum())}")


if __name__ == "__main__":
    main()
