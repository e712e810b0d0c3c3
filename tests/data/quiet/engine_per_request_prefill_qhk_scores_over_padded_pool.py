"""A serving loop in the shape of an einsum ("native") attention backend: each request is prefilled alone, its new
tokens' queries against a key buffer gathered from a paged pool and padded to a fixed bucket (64 slots, the slots past
the request's own keys masked), its scores laid out (tokens, heads, keys) by `einsum("qhd,khd->qhk")` and softmaxed by
hand. The metadata object states each request's new tokens and keys (`extend_seq_lens`, `seq_lens`): every request
starts at position 0, so the causal mask over the buffer's first keys is right (no cache before them). Checked against
F.scaled_dot_product_attention(is_causal=True) over each request's own keys."""
import math

import torch
import torch.nn.functional as F

torch.manual_seed(0)
HEADS, DIM, BUCKET = 4, 8, 64


class Batch:
    def __init__(self, seq_lens, extend_seq_lens, extend_prefix_lens):
        self.seq_lens, self.extend_seq_lens, self.extend_prefix_lens = seq_lens, extend_seq_lens, extend_prefix_lens


def extend_mask(query_len, key_len, seq_lens, prefix_lens, extend_lens):
    q_pos = prefix_lens[0] + torch.arange(query_len)
    k_pos = torch.arange(key_len)
    return (q_pos[:, None] >= k_pos[None, :]) & (k_pos[None, :] < seq_lens.sum())


def native_attention(q, k_buffer, v_buffer, batch):
    scores = torch.einsum("qhd,khd->qhk", q, k_buffer) / math.sqrt(DIM)
    keep = extend_mask(q.shape[0], k_buffer.shape[0], batch.seq_lens, batch.extend_prefix_lens, batch.extend_seq_lens)
    scores = torch.where(keep[:, None, :], scores, torch.tensor(torch.finfo(scores.dtype).min))
    top = scores.max(dim=-1, keepdim=True).values
    weights = torch.exp(scores - top)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("qhk,khd->qhd", weights, v_buffer)


def serve(lengths):
    worst = 0.0
    for n in lengths:
        batch = Batch(torch.tensor([n]), torch.tensor([n]), torch.tensor([0]))
        q, k, v = (torch.randn(n, HEADS, DIM) for _ in range(3))
        k_buffer, v_buffer = torch.zeros(BUCKET, HEADS, DIM), torch.zeros(BUCKET, HEADS, DIM)
        k_buffer[:n], v_buffer[:n] = k, v
        out = native_attention(q, k_buffer, v_buffer, batch)
        reference = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                   is_causal=True).transpose(0, 1)
        worst = max(worst, float((out - reference).abs().max()))
    return worst


if __name__ == "__main__":
    worst = serve([5, 7, 3])
    print(f"largest difference from a per-request causal SDPA: {worst:.2e}")
    assert worst < 1e-5
