# Follows NVIDIA kvpress: kvpress/presses/knorm_press.py (KnormPress.score = -keys.norm(dim=-1)) and
# kvpress/presses/scorer_press.py (ScorerPress.compress: topk per kv-head, keys.gather(2, indices)).
# After prefill each head keeps its own (unsorted) subset of keys; decode queries attend to all kept keys + new ones.
import torch
torch.manual_seed(0)
dt = torch.float64
B, H, T, D, NEW = 2, 4, 24, 8, 5
ratio = 0.5

def score(keys):  # KnormPress.score
    return -keys.norm(dim=-1)

def compress(keys, values):  # ScorerPress.compress
    n_kept = int(keys.shape[2] * (1 - ratio))
    idx = score(keys).topk(n_kept, dim=-1).indices          # (B,H,n_kept), NOT position-sorted
    gi = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    return keys.gather(2, gi), values.gather(2, gi), idx

K = torch.randn(B, H, T, D, dtype=dt) * torch.rand(B, H, T, 1, dtype=dt) * 3
V = torch.randn(B, H, T, D, dtype=dt)
ck, cv, kept_idx = compress(K, V)

newq = torch.randn(B, H, NEW, D, dtype=dt)
newk = torch.randn(B, H, NEW, D, dtype=dt)
newv = torch.randn(B, H, NEW, D, dtype=dt)

# cached decode: one token at a time, causal between new tokens comes from appending to the cache
outs = []
for t in range(NEW):
    ck = torch.cat([ck, newk[:, :, t:t+1]], 2); cv = torch.cat([cv, newv[:, :, t:t+1]], 2)
    outs.append(torch.nn.functional.scaled_dot_product_attention(newq[:, :, t:t+1], ck, cv))
cached = torch.cat(outs, 2)

# reference: full uncompressed cache, explicit per-query loop, pruned prompt keys excluded with a bool keep-mask
keep = torch.zeros(B, H, T, dtype=torch.bool)
keep.scatter_(2, kept_idx, True)
fullK = torch.cat([K, newk], 2); fullV = torch.cat([V, newv], 2)
ref = torch.empty_like(cached)
for b in range(B):
    for h in range(H):
        for t in range(NEW):
            allowed = torch.cat([keep[b, h], torch.arange(NEW) <= t])
            s = (fullK[b, h][allowed] @ newq[b, h, t]) / D ** 0.5
            ref[b, h, t] = torch.softmax(s, 0) @ fullV[b, h][allowed]
diff = (cached - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
