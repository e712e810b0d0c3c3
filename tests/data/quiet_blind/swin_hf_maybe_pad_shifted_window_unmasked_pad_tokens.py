# Follows transformers models/swin/modeling_swin.py SwinLayer: maybe_pad pads H,W up to a window multiple AFTER
# layernorm (pad tokens are zeros and are NOT masked: upstream lets them act as keys), get_attn_mask builds the
# shifted-window region mask on the padded size (-100.0 bias), then the padded rows are cropped away.
import torch, torch.nn.functional as F
torch.manual_seed(0); dt = torch.float64
H, W, ws, shift, C, nh = 6, 5, 4, 2, 16, 2; hd = C // nh
qkv = torch.nn.Linear(C, 3 * C, dtype=dt); proj = torch.nn.Linear(C, C, dtype=dt)

def window_partition(x, ws):
    B, H, W, C = x.shape
    return x.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)
def window_reverse(w, ws, H, W):
    C = w.shape[-1]
    return w.view(-1, H // ws, W // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, H, W, C)

def get_attn_mask(height, width):
    img_mask = torch.zeros((1, height, width, 1), dtype=dt)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img_mask[:, hs, wsl, :] = cnt; cnt += 1
    mw = window_partition(img_mask, ws).view(-1, ws * ws)
    am = mw.unsqueeze(1) - mw.unsqueeze(2)
    return am.masked_fill(am != 0, -100.0).masked_fill(am == 0, 0.0), img_mask

def win_attn(x, mask):
    B_, N, _ = x.shape
    q, k, v = qkv(x).view(B_, N, 3, nh, hd).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-1, -2) / hd ** 0.5
    nW = mask.shape[0]
    s = (s.view(B_ // nW, nW, nh, N, N) + mask[None, :, None]).view(B_, nh, N, N)
    return proj((s.softmax(-1) @ v).transpose(1, 2).reshape(B_, N, C))

x = torch.randn(2, H, W, C, dtype=dt)
hn = F.layer_norm(x, (C,))
pad_r, pad_b = (ws - W % ws) % ws, (ws - H % ws) % ws
hp = F.pad(hn, (0, 0, 0, pad_r, 0, pad_b))                        # maybe_pad
Hp, Wp = hp.shape[1:3]
sx = torch.roll(hp, shifts=(-shift, -shift), dims=(1, 2))
mask, img_mask = get_attn_mask(Hp, Wp)
o = win_attn(window_partition(sx, ws).view(-1, ws * ws, C), mask)
o = torch.roll(window_reverse(o.view(-1, ws, ws, C), ws, Hp, Wp), shifts=(shift, shift), dims=(1, 2))
out = o[:, :H, :W]                                                  # crop padded rows

# reference: explicit per-query loop over the padded grid; pad zeros count as keys exactly as upstream
ref = torch.zeros_like(out)
def where(i, j):
    si, sj = (i - shift) % Hp, (j - shift) % Wp
    return img_mask[0, si, sj, 0].item(), si // ws, sj // ws
for b in range(2):
    for i in range(H):
        for j in range(W):
            keys = [(a, c) for a in range(Hp) for c in range(Wp) if where(a, c) == where(i, j)]
            q = qkv(hp[b, i, j]).view(3, nh, hd)[0]
            KV = torch.stack([qkv(hp[b, a, c]).view(3, nh, hd) for a, c in keys], 0)
            a_ = torch.einsum("hd,khd->hk", q, KV[:, 1]) / hd ** 0.5
            ref[b, i, j] = proj(torch.einsum("hk,khd->hd", a_.softmax(-1), KV[:, 2]).reshape(C))
d = (out - ref).abs().max().item()
print("max diff", d); assert d < 1e-10
