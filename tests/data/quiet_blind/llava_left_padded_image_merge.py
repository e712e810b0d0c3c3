# Follows transformers models/llava/modeling_llava.py (legacy _merge_input_ids_with_image_features, left padding):
# image placeholder expanded to N patch embeddings, merged sequences left-padded; padding mask from the merged
# positions, causal + key-padding mask as float bias; position_ids from cumsum so padded rows don't shift.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H, NP, IMG = 32, 4, 4, -200
ids = [[5, IMG, 7, 8], [5, 6, IMG, 9, 10, 11]]
emb = torch.randn(20, D); patches = torch.randn(2, NP, D)
def merge(seq, p): return torch.cat([p if t == IMG else emb[t][None] for t in seq])
merged = [merge(s, patches[i]) for i, s in enumerate(ids)]
L = max(m.shape[0] for m in merged)
x = torch.stack([F.pad(m, (0, 0, L - m.shape[0], 0)) for m in merged])
am = torch.stack([torch.cat([torch.zeros(L - m.shape[0]), torch.ones(m.shape[0])]) for m in merged])
pos = (am.cumsum(-1) - 1).clamp(min=0).long()
rope = torch.randn(64, D) * 0.1
Wq, Wk, Wv = (torch.randn(D, D) / D**.5 for _ in range(3))
def attn(x, pos, bias):
    h = x + rope[pos]
    q, k, v = ((h @ W).view(x.shape[0], -1, H, D // H).transpose(1, 2) for W in (Wq, Wk, Wv))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
keep = causal[None] & am.bool()[:, None, :]
bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float64).min)[:, None]
out = attn(x, pos, bias)
diff = 0.0
for b, m in enumerate(merged):
    n = m.shape[0]
    ref = attn(m[None], torch.arange(n)[None], None if n == 1 else torch.tril(torch.ones(n, n, dtype=torch.bool)))
    diff = max(diff, (ref - out[b:b+1, :, L - n:]).abs().max().item())  # left-pad rows discarded
print("max diff", diff); assert diff < 1e-10
