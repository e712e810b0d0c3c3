# Correct program. Ported from XuezheMax/megalodon megalodon/modules/moving_average_gated_attention.py
# (chunk-wise attention: the sequence is reshaped into chunks of chunk_size, causal inside each chunk,
# with padded positions at the end of the last chunk masked out of the keys).
import torch, torch.nn.functional as F
torch.manual_seed(0)
B, L, D, chunk_size = 2, 10, 8, 4
lengths = torch.tensor([10, 7])
x = torch.randn(B, L, D)
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))
pad = (-L) % chunk_size
xp = F.pad(x, (0, 0, 0, pad))
mask = torch.arange(L + pad)[None] < lengths[:, None]           # B x Lp, True = real token
nc = (L + pad) // chunk_size
q, k, v = (w(xp).view(B, nc, chunk_size, D) for w in (wq, wk, wv))
kmask = mask.view(B, nc, chunk_size)
causal = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool))
allowed = causal[None, None] & kmask[:, :, None, :]
attn_mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
attn_mask = attn_mask.masked_fill(~kmask[..., None], 0.0)    # padded query rows: allowed.any is kept finite
s = q @ k.transpose(-1, -2) / D ** 0.5 + attn_mask
out = (s.softmax(-1) @ v).view(B, L + pad, D)[:, :L]
for b in range(B):                                          # reference double loop
    n = lengths[b].item()
    Q, K, Vv = wq(x[b, :n]), wk(x[b, :n]), wv(x[b, :n])
    for i in range(n):
        c0 = (i // chunk_size) * chunk_size
        sc = Q[i] @ K[c0:i + 1].T / D ** 0.5
        assert torch.allclose(out[b, i], sc.softmax(-1) @ Vv[c0:i + 1], atol=1e-5)
print("ok")
