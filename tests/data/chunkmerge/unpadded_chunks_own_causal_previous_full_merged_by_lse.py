"""Chunked local attention computed in two passes per chunk and merged by log-sum-exp, over an unpadded batch.

A batch of two left-padded sequences (the padding's inputs are zeros, `attention_mask` 0) is unpadded into one packed
sequence. Each sequence is split into chunks of 4 tokens; one helper, `attend(q, k, v, causal)`, computes a
hand-written softmax over (heads, queries, keys) scores of one packed sequence (`"qhd,khd->hqk"`, as flash-attn's
varlen stand-ins write it). Each chunk attends its own keys with `causal=True` and the chunk before it with
`causal=False` (all of its keys lie before the queries: local attention that looks one chunk back, as lucidrains'
local-attention does), and the two are merged by their log-sum-exp; checked against a dense masked reference per
sequence. Two heads, as many as the batch's rows.
"""

import torch
import torch.nn as nn

torch.manual_seed(0)
DIM, HEADS, CHUNK = 16, 2, 4


def attend(q, k, v, causal):
    """q [Lq, H, D], k / v [Lk, H, D]; (out [Lq, H, D], lse [H, Lq]); causal aligned bottom-right."""
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=k.shape[0] - q.shape[0])
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v), lse


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - lse).T[..., None], torch.exp(lse_b - lse).T[..., None]
    return out_a * weight_a + out_b * weight_b


class ChunkedSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.is_causal = HEADS, True
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, hidden_states, attention_mask):
        lengths = attention_mask.sum(dim=1).tolist()
        packed = hidden_states[attention_mask.bool()]  # (unpadded: one packed sequence)
        q, k, v = (t.view(-1, HEADS, DIM // HEADS) for t in self.qkv(packed).chunk(3, dim=-1))
        outputs, start = [], 0
        for length in lengths:
            for c in range(start, start + length, CHUNK):
                end = min(c + CHUNK, start + length)
                out, lse = attend(q[c:end], k[c:end], v[c:end], causal=True)
                if c > start:
                    past, past_lse = attend(q[c:end], k[c - CHUNK:c], v[c - CHUNK:c], causal=False)
                    out = merge(out, lse, past, past_lse)
                outputs.append(out)
            start += length
        packed_out = self.out(torch.cat(outputs).reshape(-1, DIM))
        result = torch.zeros_like(hidden_states)
        result[attention_mask.bool()] = packed_out
        return result


layer = ChunkedSelfAttention().eval()
attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 12])
hidden_states = torch.randn(2, 12, DIM) * attention_mask[..., None]
with torch.no_grad():
    got = layer(hidden_states, attention_mask)
    for b in range(2):
        real = hidden_states[b][attention_mask[b].bool()]
        q, k, v = (t.view(-1, HEADS, DIM // HEADS).transpose(0, 1) for t in layer.qkv(real).chunk(3, dim=-1))
        i, j = torch.arange(len(real))[:, None], torch.arange(len(real))[None, :]
        local = (j <= i) & (j // CHUNK >= i // CHUNK - 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=local).transpose(0, 1)
        assert torch.allclose(got[b][attention_mask[b].bool()], layer.out(ref.reshape(-1, DIM)), atol=1e-5)
print("chunked two-pass attention matches the local mask on every real token")
