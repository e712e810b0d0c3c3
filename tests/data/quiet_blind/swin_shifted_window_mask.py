# Follows microsoft/Swin-Transformer models/swin_transformer.py: SwinTransformerBlock.__init__ (img_mask slices,
# window_partition, attn_mask.masked_fill(!=0, -100.0)) and forward (torch.roll, window attention, reverse roll).
# The float bias stops tokens that were rolled around the border from attending across the wrap seam.
import torch
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
H = W = 8; ws = 4; shift = 2; C = 16

def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)

def window_reverse(w, ws, H, W):
    B = int(w.shape[0] / (H * W / ws / ws))
    x = w.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)

# --- attn_mask exactly as SwinTransformerBlock builds it
img_mask = torch.zeros((1, H, W, 1))
h_slices = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
w_slices = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
cnt = 0
for h in h_slices:
    for w in w_slices:
        img_mask[:, h, w, :] = cnt
        cnt += 1
mask_windows = window_partition(img_mask, ws).view(-1, ws * ws)
attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))

Wq, Wk, Wv = (torch.randn(C, C) / C ** 0.5 for _ in range(3))
x = torch.randn(2, H, W, C)

# --- Swin path: roll, partition, biased window attention, reverse, roll back
xs = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
xw = window_partition(xs, ws).view(-1, ws * ws, C)
q, k, v = xw @ Wq, xw @ Wk, xw @ Wv
s = q @ k.transpose(-2, -1) * C ** -0.5
nW = attn_mask.shape[0]
s = s.view(-1, nW, ws * ws, ws * ws) + attn_mask.unsqueeze(0)
out = (s.softmax(-1).view(-1, ws * ws, ws * ws) @ v).view(-1, ws, ws, C)
out = torch.roll(window_reverse(out, ws, H, W), shifts=(shift, shift), dims=(1, 2))

# --- reference in original coordinates, no roll: shifted windows are [0,s),[s,s+ws),...,[H-ws+s,H)
def block(i, n):
    if i < shift: return 0
    return 1 + (i - shift) // ws
ref = torch.zeros_like(x)
for b in range(2):
    for i in range(H):
        for j in range(W):
            keys = [(a, c) for a in range(H) for c in range(W) if block(a, H) == block(i, H) and block(c, W) == block(j, W)]
            kv = torch.stack([x[b, a, c] for a, c in keys])
            qq = x[b, i, j] @ Wq
            p = ((kv @ Wk) @ qq * C ** -0.5).softmax(-1)
            ref[b, i, j] = p @ (kv @ Wv)
d = (out - ref).abs().max().item()
print("max diff swin shifted-window vs per-query region loop:", d)
assert d < 1e-12
