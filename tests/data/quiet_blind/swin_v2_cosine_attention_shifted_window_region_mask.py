# Follows microsoft/Swin-Transformer models/swin_transformer_v2.py: SwinTransformerBlock (img_mask slices,
# window_partition, attn_mask = -100 where region ids differ) and WindowAttention (cosine attention, logit_scale).
# The -100 float bias keeps each shifted window from mixing tokens that were not adjacent before torch.roll.
import torch, torch.nn.functional as F
torch.manual_seed(0); dt = torch.float64
H = W = 8; ws = 4; shift = 2; C = 16; nh = 2; hd = C // nh

def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)

def window_reverse(w, ws, H, W):
    B = int(w.shape[0] / (H * W / ws / ws))
    x = w.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)

qkv = torch.nn.Linear(C, 3 * C, dtype=dt); proj = torch.nn.Linear(C, C, dtype=dt)
logit_scale = torch.log(10 * torch.ones(nh, 1, 1, dtype=dt))
rel_bias = torch.randn(nh, ws * ws, ws * ws, dtype=dt) * 0.5  # stands in for cpb_mlp output (16*sigmoid)

def window_attention(x, mask):
    B_, N, _ = x.shape
    q, k, v = qkv(x).reshape(B_, N, 3, nh, hd).permute(2, 0, 3, 1, 4)
    attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    attn = attn * torch.clamp(logit_scale, max=torch.log(torch.tensor(1. / 0.01))).exp()
    attn = attn + rel_bias.unsqueeze(0)
    if mask is not None:
        nW = mask.shape[0]
        attn = attn.view(B_ // nW, nW, nh, N, N) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, nh, N, N)
    attn = attn.softmax(-1)
    return proj((attn @ v).transpose(1, 2).reshape(B_, N, C))

# attn_mask exactly as SwinTransformerBlock.__init__
img_mask = torch.zeros((1, H, W, 1))
cnt = 0
for h in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
    for w in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        img_mask[:, h, w, :] = cnt; cnt += 1
mw = window_partition(img_mask, ws).view(-1, ws * ws)
attn_mask = mw.unsqueeze(1) - mw.unsqueeze(2)
attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0)).to(dt)

x = torch.randn(2, H, W, C, dtype=dt)
sx = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
xw = window_partition(sx, ws).view(-1, ws * ws, C)
out = window_reverse(window_attention(xw, attn_mask).view(-1, ws, ws, C), ws, H, W)
out = torch.roll(out, shifts=(shift, shift), dims=(1, 2))

# reference: per query on the unshifted grid. Query (i,j) sees key (a,b) iff after shifting both land in the
# same window AND they came from the same region (i.e. they are contiguous on the original image).
def region(i, j):
    si, sj = (i - shift) % H, (j - shift) % W  # position after roll(-shift)
    return img_mask[0, si, sj, 0].item(), si // ws, sj // ws, si % ws * ws + sj % ws
ref = torch.zeros_like(x)
for b in range(2):
    for i in range(H):
        for j in range(W):
            rq, wi, wj, pq = region(i, j)
            keys = [(a, c) for a in range(H) for c in range(W) if region(a, c)[1:3] == (wi, wj)]
            keys = [(a, c) for a, c in keys if region(a, c)[0] == rq]
            q, k, v = qkv(x[b, i, j]).view(3, nh, hd)
            K = torch.stack([qkv(x[b, a, c]).view(3, nh, hd)[1] for a, c in keys], 1)
            V = torch.stack([qkv(x[b, a, c]).view(3, nh, hd)[2] for a, c in keys], 1)
            pk = torch.tensor([region(a, c)[3] for a, c in keys])
            s = (F.normalize(q, dim=-1).unsqueeze(1) * F.normalize(K, dim=-1)).sum(-1) * 10
            s = s + rel_bias[:, pq, pk]
            ref[b, i, j] = proj((s.softmax(-1).unsqueeze(-1) * V).sum(1).reshape(C))
d = (out - ref).abs().max().item()
print("max diff", d); assert d < 1e-10
