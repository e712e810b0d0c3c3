"""HSTU generative recommender: jagged user histories, pointwise SiLU attention with a causal validity mask.

Follows meta-recsys/generative-recommenders:
  generative_recommenders/ops/pytorch/pt_hstu_attention.py  pytorch_hstu_mha(max_seq_len, alpha, q, k, v,
      seq_offsets, causal): jagged_to_padded_dense, qk = einsum * alpha, silu(qk) / max_seq_len,
      valid_attn_mask = causal (row >= col) & both ids < seq_len, multiplied in (no softmax), dense_to_jagged
  generative_recommenders/modules/hstu.py / stu.py  STULayer: uvqk = silu(linear(layer_norm(x))), u gates the
      layer-normed attention output, residual; relative position bias omitted here
  sequential encoder: positional embedding by index in the history, next-item logits at each step
Reduced: 3 users with 7, 3 and 5 items given as values + offsets (jagged), MAX_SEQ_LEN 10 (the model's fixed
constant, not the batch width), hidden 16, 2 heads, 2 layers, float64.
Reference: each user's history alone (offsets [0, n]) through the same code; and a plain loop per query.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
N_ITEMS, D, H, MAX_SEQ_LEN = 30, 16, 2, 10
HD = D // H
ALPHA = 1.0 / HD ** 0.5


def jagged_to_padded_dense(values, offsets, n):
    b = offsets.numel() - 1
    out = values.new_zeros(b, n, *values.shape[1:])
    for i in range(b):
        s, e = offsets[i].item(), offsets[i + 1].item()
        out[i, : e - s] = values[s:e]
    return out


def dense_to_jagged(dense, offsets):
    return torch.cat([dense[i, : offsets[i + 1] - offsets[i]] for i in range(offsets.numel() - 1)])


def pytorch_hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal=True):
    n = int((seq_offsets[1:] - seq_offsets[:-1]).max())
    pq, pk, pv = (jagged_to_padded_dense(t, seq_offsets, n) for t in (q, k, v))   # (B, n, H, d)
    qk = torch.einsum("bnhd,bmhd->bhnm", pq, pk) * alpha
    qk = F.silu(qk) / max_seq_len
    seq_lengths = seq_offsets[1:] - seq_offsets[:-1]
    ids = torch.arange(n)
    valid = ids[None, :, None] < seq_lengths[:, None, None]
    valid = valid & (ids[None, None, :] < seq_lengths[:, None, None])
    if causal:
        valid = valid & (ids[:, None] >= ids[None, :])[None]
    qk = qk * valid.unsqueeze(1)
    out = torch.einsum("bhnm,bmhd->bnhd", qk, pv)
    return dense_to_jagged(out, seq_offsets)


class STULayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.uvqk = nn.Linear(D, 4 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x, seq_offsets):
        u, v, q, k = F.silu(self.uvqk(F.layer_norm(x, (D,)))).split(D, -1)
        a = pytorch_hstu_mha(MAX_SEQ_LEN, ALPHA, q.view(-1, H, HD), k.view(-1, H, HD), v.view(-1, H, HD),
                             seq_offsets).reshape(-1, D)
        return x + self.out(u * F.layer_norm(a, (D,)))


class HSTU(nn.Module):
    def __init__(self):
        super().__init__()
        self.item_emb = nn.Embedding(N_ITEMS, D)
        self.pos_emb = nn.Embedding(MAX_SEQ_LEN, D)
        self.layers = nn.ModuleList([STULayer() for _ in range(2)])

    def forward(self, items, seq_offsets):
        pos = torch.cat([torch.arange(e - s) for s, e in zip(seq_offsets[:-1].tolist(), seq_offsets[1:].tolist())])
        x = self.item_emb(items) * D ** 0.5 + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x, seq_offsets)
        x = F.layer_norm(x, (D,))
        return x @ self.item_emb.weight.T     # next-item logits at every step


histories = [torch.randint(0, N_ITEMS, (n,)) for n in (7, 3, 5)]
items = torch.cat(histories)
offsets = torch.tensor([0] + torch.tensor([len(h) for h in histories]).cumsum(0).tolist())

model = HSTU().eval()
with torch.no_grad():
    logits = model(items, offsets)
    max_diff = 0.0
    for i, h in enumerate(histories):
        ref = model(h, torch.tensor([0, len(h)]))
        max_diff = max(max_diff, (logits[offsets[i]:offsets[i + 1]] - ref).abs().max().item())
    # the attention itself against a per-query loop over earlier items of the same user
    q, k, v = (torch.randn(len(items), H, HD) for _ in range(3))
    att = pytorch_hstu_mha(MAX_SEQ_LEN, ALPHA, q, k, v, offsets)
    for i in range(3):
        s, e = offsets[i].item(), offsets[i + 1].item()
        for t in range(s, e):
            w = F.silu(torch.einsum("hd,mhd->hm", q[t], k[s:t + 1]) * ALPHA) / MAX_SEQ_LEN
            max_diff = max(max_diff, (att[t] - torch.einsum("hm,mhd->hd", w, v[s:t + 1])).abs().max().item())

print("jagged logits", tuple(logits.shape), "offsets", offsets.tolist())
print("max |jagged batch - each user alone / loop|:", max_diff)
assert max_diff < 1e-10
