# Follows lucidrains/perceiver-ar-pytorch perceiver_ar_pytorch/perceiver_ar_pytorch.py (CausalPrefixAttention):
# the last N tokens become latent queries that cross-attend to prefix + themselves; causal mask is
# triu(ones(i, j), j - i + 1) (True = masked), and prefix key padding (mask True = keep) is applied on the left.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, L, N = 32, 14, 4    # N latents at the end, L - N prefix tokens
Wq, Wk, Wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))

def prefix_attn(x, context, context_mask):
    q = x @ Wq
    kv_in = torch.cat([context, x], 1)
    k, v = kv_in @ Wk, kv_in @ Wv
    sim = q @ k.transpose(1, 2) / D ** 0.5
    i, j = sim.shape[-2:]
    keep = torch.cat([context_mask, torch.ones(x.shape[0], i, dtype=torch.bool)], 1)  # latents always kept
    sim = sim.masked_fill(~keep[:, None, :], -torch.finfo(sim.dtype).max)
    causal = torch.ones(i, j, dtype=torch.bool).triu(j - i + 1)
    sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
    return sim.softmax(-1) @ v

seqs = [torch.randn(L, D), torch.randn(9, D)]   # second is shorter: left-pad its prefix
B = len(seqs)
x = torch.zeros(B, L, D); cmask = torch.zeros(B, L - N, dtype=torch.bool)
for b, s in enumerate(seqs):
    x[b, L - s.shape[0]:] = s; cmask[b, L - s.shape[0]:] = True
out = prefix_attn(x[:, L - N:], x[:, : L - N], cmask)
diff = 0.0
for b, s in enumerate(seqs):
    n = s.shape[0]
    for t in range(N):  # latent t sits at position n - N + t in the unpadded sequence and sees 0..that position
        p = n - N + t
        sc = (s[p] @ Wq) @ (s[: p + 1] @ Wk).T / D ** 0.5
        ref = sc.softmax(0) @ (s[: p + 1] @ Wv)
        diff = max(diff, (out[b, t] - ref).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
