# Follows mistralai/mistral-src (one_file_ref.py / cache.py RotatingBufferCache): sliding_window W, cache slot = pos % W,
# chunked prefill whose mask is causal AND pos_q - pos_k < W over [cached keys, chunk keys], given as a float bias (-inf).
# Rolled cache keys are unrolled back into position order first. Checked against a full-sequence windowed mask.
import torch, torch.nn.functional as F
torch.manual_seed(9)
D, T, W, CH = 16, 23, 6, 5
def rope(x, pos):
    half = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = pos[:, None].double() * inv[None]; c, s = ang.cos(), ang.sin()
    return torch.cat([x[..., :half] * c - x[..., half:] * s, x[..., :half] * s + x[..., half:] * c], -1)
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / D**0.5 for _ in range(3))
x = torch.randn(T, D, dtype=torch.float64); p = torch.arange(T)
Q, K, V = rope(x @ Wq, p), rope(x @ Wk, p), x @ Wv
ck = torch.zeros(W, D, dtype=torch.float64); cv = ck.clone(); outs = []
for s in range(0, T, CH):
    e = min(T, s + CH); n_cached = min(s, W)
    cpos = torch.arange(s - n_cached, s)
    kk = torch.cat([ck[cpos % W], K[s:e]]); vv = torch.cat([cv[cpos % W], V[s:e]])   # unroll the rotating buffer
    kpos = torch.cat([cpos, p[s:e]]); qpos = p[s:e]
    ok = (kpos[None] <= qpos[:, None]) & (qpos[:, None] - kpos[None] < W)
    bias = torch.zeros(ok.shape, dtype=torch.float64).masked_fill(~ok, float('-inf'))
    outs.append(F.scaled_dot_product_attention(Q[s:e][None], kk[None], vv[None], attn_mask=bias[None])[0])
    ck[p[s:e] % W] = K[s:e]; cv[p[s:e] % W] = V[s:e]       # later writes overwrite the oldest slots
out = torch.cat(outs)
okf = (p[None] <= p[:, None]) & (p[:, None] - p[None] < W)
ref = F.scaled_dot_product_attention(Q[None], K[None], V[None], attn_mask=okf[None])[0]
diff = (out - ref).abs().max().item()
print("chunked prefill with rotating buffer vs full windowed mask max diff", diff)
assert diff < 1e-12
