# Follows FMInference/H2O h2o_hf/utils_real_drop/modify_llama.py H2OKVCache_LayerWise: accumulated attention scores pick
# heavy hitters, the recent window is always kept, the rest is evicted; kept keys keep their ORIGINAL RoPE positions.
# The cached run drops keys; the reference attends to the full history with a boolean keep-mask (True = keep) per query.
import torch, torch.nn.functional as F
torch.manual_seed(3)
D, T, HH, REC = 16, 22, 3, 4

def rope(x, pos):
    half = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = pos[:, None].double() * inv[None]
    c, s = ang.cos(), ang.sin()
    return torch.cat([x[..., :half] * c - x[..., half:] * s, x[..., :half] * s + x[..., half:] * c], -1)

Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / D**0.5 for _ in range(3))
x = torch.randn(T, D, dtype=torch.float64); p = torch.arange(T)
Q, K, V = rope(x @ Wq, p), rope(x @ Wk, p), x @ Wv

ids = torch.empty(0, dtype=torch.long); score = torch.empty(0, dtype=torch.float64)
outs, keepsets = [], []
for t in range(T):
    ids = torch.cat([ids, torch.tensor([t])]); score = torch.cat([score, torch.zeros(1, dtype=torch.float64)])
    w = torch.softmax(Q[t] @ K[ids].T / D**0.5, -1)
    outs.append(w @ V[ids]); keepsets.append(ids.clone())
    score = score + w
    if ids.numel() > HH + REC:  # evict: keep top-HH among non-recent plus the REC most recent
        sel = score[:-REC].topk(HH).indices.sort().values
        keep = torch.cat([sel, torch.arange(ids.numel() - REC, ids.numel())])
        ids, score = ids[keep], score[keep]
out = torch.stack(outs)
refs = []
for t in range(T):
    keep = torch.zeros(1, t + 1, dtype=torch.bool); keep[0, keepsets[t]] = True
    refs.append(F.scaled_dot_product_attention(Q[t:t+1][None], K[:t+1][None], V[:t+1][None], attn_mask=keep[None])[0, 0])
diff = (out - torch.stack(refs)).abs().max().item()
print("H2O evicted cache vs full history + keep mask max diff", diff)
assert diff < 1e-12
