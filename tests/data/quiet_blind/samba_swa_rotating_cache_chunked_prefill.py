# Follows mistralai/mistral-inference src/mistral_inference/cache.py (RotatingBufferCache: slot = position % window,
# keys kept in ring order) and generate.py chunked prefill, as the sliding-window layer of a Samba-style hybrid.
# The mask is built from stored positions, not indices; left-pad queries see nothing (finfo.min bias) and are dropped.
import torch
torch.manual_seed(7)
torch.set_default_dtype(torch.float64)
D, WIN, CHUNK = 32, 5, 3
Wq, Wk, Wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))
a = torch.rand(D) * 0.9
NEG = torch.finfo(torch.float64).min

lens = [13, 8]
T = max(lens)
x = torch.randn(2, T, D)
attn_mask = torch.zeros(2, T, dtype=torch.long)
for b, n in enumerate(lens):
    attn_mask[b, T - n:] = 1          # left padding
position_ids = (attn_mask.cumsum(-1) - 1).masked_fill(attn_mask == 0, -1)

k_cache = torch.zeros(2, WIN, D); v_cache = torch.zeros(2, WIN, D)
pos_cache = torch.full((2, WIN), -1)
state = torch.zeros(2, D)
outs = []
for c0 in range(0, T, CHUNK):
    xc, pc = x[:, c0:c0 + CHUNK], position_ids[:, c0:c0 + CHUNK]
    hs = []
    for t in range(xc.shape[1]):                     # recurrent half of the hybrid; pads leave the state alone
        valid = (pc[:, t] >= 0)[:, None]
        state = torch.where(valid, a * state + xc[:, t], state)
        hs.append(xc[:, t] + state)
    h = torch.stack(hs, 1)
    q, k, v = h @ Wq, h @ Wk, h @ Wv
    K = torch.cat([k_cache, k], 1); V = torch.cat([v_cache, v], 1)
    kpos = torch.cat([pos_cache, pc], 1)             # ring order: not sorted by position
    rel = pc[:, :, None] - kpos[:, None, :]
    keep = (kpos[:, None, :] >= 0) & (pc[:, :, None] >= 0) & (rel >= 0) & (rel < WIN)
    bias = torch.zeros(keep.shape).masked_fill(~keep, NEG)
    o = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=bias)
    outs.append(h + o)
    for t in range(xc.shape[1]):                     # write chunk into the rotating buffer
        for b in range(2):
            p = int(pc[b, t])
            if p >= 0:
                s = p % WIN
                k_cache[b, s], v_cache[b, s], pos_cache[b, s] = k[b, t], v[b, t], p
out = torch.cat(outs, 1)

# reference: each row alone, unpadded, whole sequence, explicit per-query sliding-window loop
d = 0.0
for b, n in enumerate(lens):
    xs = x[b, T - n:]
    st = torch.zeros(D); hs = []
    for t in range(n):
        st = a * st + xs[t]; hs.append(xs[t] + st)
    h = torch.stack(hs)
    for i in range(n):
        lo = max(0, i - WIN + 1)
        s = (h[lo:i + 1] @ Wk) @ (h[i] @ Wq) / D ** 0.5
        r = h[i] + s.softmax(-1) @ (h[lo:i + 1] @ Wv)
        d = max(d, (out[b, T - n + i] - r).abs().max().item())
print("max diff chunked rotating-cache prefill (left-padded batch) vs per-row loop:", d)
assert d < 1e-12
