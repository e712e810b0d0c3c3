# Uformer (ZhendongWang6/Uformer commit c715ca5, "fixed mask"), LeWinTransformerBlock.forward:
# the SW-MSA mask is built from an all-zero img_mask (no shifted-window region labels), so with no input mask the
# shifted windows get an all-zero mask and tokens wrapped around by the cyclic roll attend each other.
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def to_2tuple(x):
    return (x, x)


class LinearProjection(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0., bias=True):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.to_q = nn.Linear(dim, inner_dim, bias=bias)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=bias)

    def forward(self, x, attn_kv=None):
        B_, N, C = x.shape
        attn_kv = x if attn_kv is None else attn_kv
        q = self.to_q(x).reshape(B_, N, 1, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        kv = self.to_kv(attn_kv).reshape(B_, N, 2, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q = q[0]
        k, v = kv[0], kv[1]
        return q, k, v


class WindowAttention(nn.Module):
    def __init__(self, dim, win_size, num_heads, token_projection='linear', qkv_bias=True, qk_scale=None,
                 attn_drop=0., proj_drop=0., se_layer=False):
        super().__init__()
        self.dim = dim
        self.win_size = win_size  # Wh, Ww
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim ** -0.5

        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * win_size[0] - 1) * (2 * win_size[1] - 1), num_heads))  # 2*Wh-1 * 2*Ww-1, nH

        coords_h = torch.arange(self.win_size[0])
        coords_w = torch.arange(self.win_size[1])
        coords = torch.stack(torch.meshgrid([coords_h, coords_w], indexing="ij"))  # 2, Wh, Ww
        coords_flatten = torch.flatten(coords, 1)  # 2, Wh*Ww
        relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]  # 2, Wh*Ww, Wh*Ww
        relative_coords = relative_coords.permute(1, 2, 0).contiguous()  # Wh*Ww, Wh*Ww, 2
        relative_coords[:, :, 0] += self.win_size[0] - 1
        relative_coords[:, :, 1] += self.win_size[1] - 1
        relative_coords[:, :, 0] *= 2 * self.win_size[1] - 1
        relative_position_index = relative_coords.sum(-1)  # Wh*Ww, Wh*Ww
        self.register_buffer("relative_position_index", relative_position_index)

        self.qkv = LinearProjection(dim, num_heads, dim // num_heads, bias=qkv_bias)

        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.se_layer = nn.Identity()
        self.proj_drop = nn.Dropout(proj_drop)

        nn.init.trunc_normal_(self.relative_position_bias_table, std=.02)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x, attn_kv=None, mask=None):
        B_, N, C = x.shape
        q, k, v = self.qkv(x, attn_kv)
        q = q * self.scale
        attn = (q @ k.transpose(-2, -1))

        relative_position_bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
            self.win_size[0] * self.win_size[1], self.win_size[0] * self.win_size[1], -1)  # Wh*Ww,Wh*Ww,nH
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()  # nH, Wh*Ww, Wh*Ww
        ratio = attn.size(-1) // relative_position_bias.size(-1)
        # einops repeat 'nH l c -> nH l (c d)'
        relative_position_bias = relative_position_bias.repeat_interleave(ratio, dim=-1)

        attn = attn + relative_position_bias.unsqueeze(0)

        if mask is not None:
            nW = mask.shape[0]
            mask = mask.repeat_interleave(ratio, dim=-1)  # einops repeat 'nW m n -> nW m (n d)'
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N * ratio) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N * ratio)
            attn = self.softmax(attn)
        else:
            attn = self.softmax(attn)

        attn = self.attn_drop(attn)

        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        x = self.proj(x)
        x = self.se_layer(x)
        x = self.proj_drop(x)
        return x


class LeFF(nn.Module):
    def __init__(self, dim=32, hidden_dim=128, act_layer=nn.GELU, drop=0.):
        super().__init__()
        self.linear1 = nn.Sequential(nn.Linear(dim, hidden_dim), act_layer())
        self.dwconv = nn.Sequential(nn.Conv2d(hidden_dim, hidden_dim, groups=hidden_dim, kernel_size=3, stride=1,
                                              padding=1), act_layer())
        self.linear2 = nn.Sequential(nn.Linear(hidden_dim, dim))

    def forward(self, x):
        bs, hw, c = x.size()
        hh = int(math.sqrt(hw))
        x = self.linear1(x)
        x = x.transpose(1, 2).reshape(bs, -1, hh, hh)  # ' b (h w) (c) -> b c h w '
        x = self.dwconv(x)
        x = x.flatten(2).transpose(1, 2)  # ' b c h w -> b (h w) c'
        x = self.linear2(x)
        return x


def window_partition(x, win_size):
    B, H, W, C = x.shape
    x = x.view(B, H // win_size, win_size, W // win_size, win_size, C)
    windows = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, win_size, win_size, C)
    return windows


def window_reverse(windows, win_size, H, W):
    B = int(windows.shape[0] / (H * W / win_size / win_size))
    x = windows.view(B, H // win_size, W // win_size, win_size, win_size, -1)
    x = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)
    return x


class LeWinTransformerBlock(nn.Module):
    def __init__(self, dim, input_resolution, num_heads, win_size=8, shift_size=0,
                 mlp_ratio=4., qkv_bias=True, qk_scale=None, drop=0., attn_drop=0., drop_path=0.,
                 act_layer=nn.GELU, norm_layer=nn.LayerNorm, token_projection='linear', token_mlp='leff',
                 se_layer=False):
        super().__init__()
        self.dim = dim
        self.input_resolution = input_resolution
        self.num_heads = num_heads
        self.win_size = win_size
        self.shift_size = shift_size
        self.mlp_ratio = mlp_ratio
        if min(self.input_resolution) <= self.win_size:
            self.shift_size = 0
            self.win_size = min(self.input_resolution)
        assert 0 <= self.shift_size < self.win_size, "shift_size must in 0-win_size"

        self.norm1 = norm_layer(dim)
        self.attn = WindowAttention(
            dim, win_size=to_2tuple(self.win_size), num_heads=num_heads,
            qkv_bias=qkv_bias, qk_scale=qk_scale, attn_drop=attn_drop, proj_drop=drop,
            token_projection=token_projection, se_layer=se_layer)

        self.drop_path = nn.Identity()  # DropPath(0.)
        self.norm2 = norm_layer(dim)
        mlp_hidden_dim = int(dim * mlp_ratio)
        self.mlp = LeFF(dim, mlp_hidden_dim, act_layer=act_layer, drop=drop)

    def forward(self, x, mask=None):
        B, L, C = x.shape
        H = int(math.sqrt(L))
        W = int(math.sqrt(L))

        if not FIXED:
            if self.shift_size > 0:
                # calculate attention mask for SW-MSA
                img_mask = torch.zeros((1, H, W, 1)).type_as(x)

                if mask != None:
                    img_mask = img_mask + F.interpolate(mask, size=(H, W)).permute(0, 2, 3, 1)  # 1 H W 1

                mask_windows = window_partition(img_mask, self.win_size)  # nW, window_size, window_size, 1
                mask_windows = mask_windows.view(-1, self.win_size * self.win_size)
                attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
                attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))
            else:
                if mask != None:
                    attn_mask = F.interpolate(mask, size=(H, W)).permute(0, 2, 3, 1)
                    attn_mask = window_partition(attn_mask, self.win_size)
                    attn_mask = attn_mask.view(-1, self.win_size * self.win_size).unsqueeze(1)
                    attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0))
                else:
                    attn_mask = None
        else:
            ## input mask
            if mask != None:
                input_mask = F.interpolate(mask, size=(H, W)).permute(0, 2, 3, 1)
                input_mask_windows = window_partition(input_mask, self.win_size)  # nW, window_size, window_size, 1
                attn_mask = input_mask_windows.view(-1, self.win_size * self.win_size)  # nW, window_size*window_size
                attn_mask = attn_mask.unsqueeze(2) * attn_mask.unsqueeze(1)  # nW, ws*ws, ws*ws
                attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))
            else:
                attn_mask = None

            ## shift mask
            if self.shift_size > 0:
                # calculate attention mask for SW-MSA
                shift_mask = torch.zeros((1, H, W, 1)).type_as(x)
                h_slices = (slice(0, -self.win_size),
                            slice(-self.win_size, -self.shift_size),
                            slice(-self.shift_size, None))
                w_slices = (slice(0, -self.win_size),
                            slice(-self.win_size, -self.shift_size),
                            slice(-self.shift_size, None))
                cnt = 0
                for h in h_slices:
                    for w in w_slices:
                        shift_mask[:, h, w, :] = cnt
                        cnt += 1
                shift_mask_windows = window_partition(shift_mask, self.win_size)  # nW, window_size, window_size, 1
                shift_mask_windows = shift_mask_windows.view(-1, self.win_size * self.win_size)  # nW, ws*ws
                shift_attn_mask = shift_mask_windows.unsqueeze(1) - shift_mask_windows.unsqueeze(2)  # nW, ws*ws, ws*ws
                attn_mask = attn_mask or shift_attn_mask
                attn_mask = attn_mask.masked_fill(shift_attn_mask != 0, float(-100.0))

        shortcut = x
        x = self.norm1(x)
        x = x.view(B, H, W, C)

        # cyclic shift
        if self.shift_size > 0:
            shifted_x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        else:
            shifted_x = x

        # partition windows
        x_windows = window_partition(shifted_x, self.win_size)  # nW*B, win_size, win_size, C
        x_windows = x_windows.view(-1, self.win_size * self.win_size, C)  # nW*B, win_size*win_size, C

        # W-MSA/SW-MSA
        attn_windows = self.attn(x_windows, mask=attn_mask)  # nW*B, win_size*win_size, C

        # merge windows
        attn_windows = attn_windows.view(-1, self.win_size, self.win_size, C)
        shifted_x = window_reverse(attn_windows, self.win_size, H, W)  # B H' W' C

        # reverse cyclic shift
        if self.shift_size > 0:
            x = torch.roll(shifted_x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        else:
            x = shifted_x
        x = x.view(B, H * W, C)

        # FFN
        x = shortcut + self.drop_path(x)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        del attn_mask
        return x


# ---- reference: per-token loop over the keys a shifted window may attend to ----
def reference_block(blk, x):
    """Each token sits at (p - shift) mod size on the rolled grid and attends only to tokens of the same rolled
    window that came from the same side of the wrap-around (Swin region labels)."""
    B, L, C = x.shape
    H = W = int(math.sqrt(L))
    ws, s, nh = blk.win_size, blk.shift_size, blk.num_heads
    h = torch.roll(blk.norm1(x).view(B, H, W, C), shifts=(-s, -s), dims=(1, 2)).reshape(B, L, C)
    q, k, v = blk.attn.qkv(h)  # B, nh, L, d
    rr, cc = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    rr, cc = rr.reshape(-1), cc.reshape(-1)
    win = (rr // ws) * (W // ws) + cc // ws
    lab = ((rr >= H - ws).long() + (rr >= H - s).long()) * 3 + (cc >= W - ws).long() + (cc >= W - s).long()
    allowed = (win[:, None] == win[None, :]) & (lab[:, None] == lab[None, :])
    local = (rr % ws) * ws + cc % ws
    bias = blk.attn.relative_position_bias_table[blk.attn.relative_position_index[local[:, None], local[None, :]]]
    scores = (q * blk.attn.scale) @ k.transpose(-2, -1) + bias.permute(2, 0, 1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, C)
    out = blk.attn.proj(out).view(B, H, W, C)
    out = torch.roll(out, shifts=(s, s), dims=(1, 2)).reshape(B, L, C)
    y = x + out
    return y + blk.mlp(blk.norm2(y))


dim, res = 32, 16
blocks = nn.ModuleList([
    LeWinTransformerBlock(dim, (res, res), num_heads=2, win_size=8, shift_size=0 if i % 2 == 0 else 4,
                          token_mlp='leff')
    for i in range(2)
]).eval()
with torch.no_grad():
    x = torch.randn(2, res * res, dim)
    h = blocks[0](x)  # W-MSA block (as in BasicUformerLayer)
    out = blocks[1](h)  # SW-MSA block, called without an input mask (mask=None) as Uformer.forward does
    ref = reference_block(blocks[1], h)
print(f"shifted LeWinTransformerBlock vs per-token shifted-window reference: max |diff| = "
      f"{(out - ref).abs().max().item():.6f}")
