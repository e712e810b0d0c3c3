# Follows torchtune: torchtune/models/gemma2/_attention.py Gemma2Attention.forward (bool mask -> -2.3819763e38 bias,
# triu/tril sliding window applied on top, tanh softcapping before adding the mask) fed with the packed-sample mask of
# torchtune/modules/attention_utils.py create_block_causal_mask(seq_lens). Window and document both restrict each query.
import torch
import torch.nn.functional as F
torch.manual_seed(8)
dt = torch.float64
D, H, W, CAP = 32, 4, 4, 5.0
hd = D // H
seq_lens = [[7, 3, 9, 5], [12, 12]]
S = 24

def create_block_causal_mask(seq_lens):
    masks = []
    for lens in seq_lens:
        blocks = [torch.tril(torch.ones(l, l, dtype=torch.bool)) for l in lens]
        masks.append(torch.block_diag(*blocks))
    return torch.stack(masks)

Wq, Wk, Wv, Wo = (torch.randn(D, D, dtype=dt) / D ** 0.5 * 3 for _ in range(4))
scaling = hd ** -0.5

def gemma2_attention(x, mask):
    b, s, _ = x.shape
    q = (x @ Wq).view(b, s, H, hd).transpose(1, 2) * scaling
    k = (x @ Wk).view(b, s, H, hd).transpose(1, 2)
    v = (x @ Wv).view(b, s, H, hd).transpose(1, 2)
    output = torch.matmul(q, k.transpose(2, 3))
    if mask is None:
        mask = torch.tril(torch.ones(size=(s, s), dtype=torch.bool))
    if mask.dtype == torch.bool:
        mask = torch.where(mask.logical_not(), -2.3819763e38, 0)
    all_ones = torch.ones_like(mask)
    sliding_mask = torch.triu(all_ones, -1 * W + 1) * torch.tril(all_ones, W - 1)
    mask = torch.where(sliding_mask == 1, mask, -2.3819763e38)
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    output = torch.tanh(output / CAP) * CAP
    output = output + mask
    output = F.softmax(output, dim=-1).type_as(q)
    output = torch.matmul(output, v)
    return output.transpose(1, 2).contiguous().view(b, s, -1) @ Wo

x = torch.randn(len(seq_lens), S, D, dtype=dt)
out = gemma2_attention(x, create_block_causal_mask(seq_lens))

# reference: explicit per-query loop inside each document, keys in [t-W+1, t]
diff = 0.0
for b, lens in enumerate(seq_lens):
    start = 0
    for L in lens:
        xd = x[b, start:start + L]
        q = (xd @ Wq).view(L, H, hd) * scaling; k = (xd @ Wk).view(L, H, hd); v = (xd @ Wv).view(L, H, hd)
        rows = []
        for t in range(L):
            lo = max(0, t - W + 1)
            s_ = torch.tanh(torch.einsum("hd,khd->hk", q[t], k[lo:t + 1]) / CAP) * CAP
            rows.append(torch.einsum("hk,khd->hd", s_.softmax(-1), v[lo:t + 1]).reshape(-1))
        ref = torch.stack(rows) @ Wo
        diff = max(diff, (out[b, start:start + L] - ref).abs().max().item())
        start += L
print("max diff", diff)
assert diff < 1e-12
