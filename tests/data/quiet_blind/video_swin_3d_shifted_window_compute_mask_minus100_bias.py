# Video-Swin-Transformer (mmaction/models/backbones/swin_transformer.py: compute_mask, window_partition,
# SwinTransformerBlock3D.forward_part1): after torch.roll by -shift in (D,H,W), tokens from different pre-roll regions
# share a window; the mask is a float bias, 0 for same region and -100.0 (not -inf) otherwise, added per window.
import torch
from functools import reduce
from operator import mul
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
B, D, H, W, C, NH = 2, 4, 6, 6, 32, 4
ws, ss = (2, 3, 3), (1, 1, 1)

def window_partition(x, window_size):
    B, D, H, W, C = x.shape
    x = x.view(B, D // window_size[0], window_size[0], H // window_size[1], window_size[1], W // window_size[2], window_size[2], C)
    return x.permute(0, 1, 3, 5, 2, 4, 6, 7).contiguous().view(-1, reduce(mul, window_size), C)

def window_reverse(windows, window_size, B, D, H, W):
    x = windows.view(B, D // window_size[0], H // window_size[1], W // window_size[2], window_size[0], window_size[1], window_size[2], -1)
    return x.permute(0, 1, 4, 2, 5, 3, 6, 7).contiguous().view(B, D, H, W, -1)

def compute_mask(D, H, W, window_size, shift_size):
    img_mask = torch.zeros((1, D, H, W, 1))
    cnt = 0
    for d in slice(-window_size[0]), slice(-window_size[0], -shift_size[0]), slice(-shift_size[0], None):
        for h in slice(-window_size[1]), slice(-window_size[1], -shift_size[1]), slice(-shift_size[1], None):
            for w in slice(-window_size[2]), slice(-window_size[2], -shift_size[2]), slice(-shift_size[2], None):
                img_mask[:, d, h, w, :] = cnt
                cnt += 1
    mask_windows = window_partition(img_mask, window_size).squeeze(-1)
    attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
    return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))

qkv, proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
hd = C // NH

def window_attention(x, mask):
    B_, N, _ = x.shape
    q, k, v = qkv(x).reshape(B_, N, 3, NH, hd).permute(2, 0, 3, 1, 4)
    attn = (q * hd ** -0.5) @ k.transpose(-2, -1)
    nW = mask.shape[0]
    attn = attn.view(B_ // nW, nW, NH, N, N) + mask.unsqueeze(1).unsqueeze(0)
    attn = attn.view(-1, NH, N, N).softmax(-1)
    return proj((attn @ v).transpose(1, 2).reshape(B_, N, C))

with torch.no_grad():
    x = torch.randn(B, D, H, W, C)
    shifted = torch.roll(x, shifts=(-ss[0], -ss[1], -ss[2]), dims=(1, 2, 3))
    out = window_attention(window_partition(shifted, ws), compute_mask(D, H, W, ws, ss))
    out = torch.roll(window_reverse(out, ws, B, D, H, W), shifts=ss, dims=(1, 2, 3))
    # reference: no roll; in original coordinates the shifted windows are floor((p - s) / w) per axis (no wrap)
    coords = torch.stack(torch.meshgrid(torch.arange(D), torch.arange(H), torch.arange(W), indexing="ij"), -1).view(-1, 3)
    gid = torch.div(coords - torch.tensor(ss), torch.tensor(ws), rounding_mode="floor")
    xf = x.view(B, -1, C); ref = torch.zeros_like(xf)
    for i in range(xf.shape[1]):
        sel = (gid == gid[i]).all(-1)
        q = qkv(xf[:, i])[:, :C].view(B, NH, hd); k, v = qkv(xf[:, sel])[..., C:].split(C, -1)
        k = k.view(B, -1, NH, hd); v = v.view(B, -1, NH, hd)
        p = torch.einsum("bhd,bkhd->bhk", q * hd ** -0.5, k).softmax(-1)
        ref[:, i] = proj(torch.einsum("bhk,bkhd->bhd", p, v).reshape(B, C))
    diff = (out.view(B, -1, C) - ref).abs().max().item()
    print("max diff 3D shifted-window -100 bias vs per-query loop over unwrapped shifted windows:", diff)
    assert diff < 1e-10
