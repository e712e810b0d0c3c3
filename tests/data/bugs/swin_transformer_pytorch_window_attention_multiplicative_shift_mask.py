# berniwal/swin-transformer-pytorch commit ae5ae7b ("mask fix"), WindowAttention of the shifted SwinBlock:
# the shifted-window mask is a 1/0 matrix multiplied into the logits (dots *= mask), so masked pairs get score 0
# instead of -inf and tokens still attend across the wrapped-around sub-windows; the fix adds a 0/-inf mask.
import sys

import torch
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# einops.rearrange patterns of the upstream file, written with view/permute (einops is not installed here)
def to_windows(t, h, ws):  # 'b (nw_h w_h) (nw_w w_w) (h d) -> b h (nw_h nw_w) (w_h w_w) d'
    b, H, W, hd = t.shape
    nw_h, nw_w, d = H // ws, W // ws, hd // h
    return t.view(b, nw_h, ws, nw_w, ws, h, d).permute(0, 5, 1, 3, 2, 4, 6).reshape(b, h, nw_h * nw_w, ws * ws, d)


def from_windows(t, h, ws, nw_h, nw_w):  # 'b h (nw_h nw_w) (w_h w_w) d -> b (nw_h w_h) (nw_w w_w) (h d)'
    b, _, _, _, d = t.shape
    return t.view(b, h, nw_h, nw_w, ws, ws, d).permute(0, 2, 4, 3, 5, 1, 6).reshape(b, nw_h * ws, nw_w * ws, h * d)


class CyclicShift(nn.Module):
    def __init__(self, displacement):
        super().__init__()
        self.displacement = displacement

    def forward(self, x):
        return torch.roll(x, shifts=(self.displacement, self.displacement), dims=(1, 2))


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(x, **kwargs) + x


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim))

    def forward(self, x):
        return self.net(x)


def create_mask(window_size, displacement, upper_lower, left_right):
    if FIXED:
        mask = torch.zeros(window_size ** 2, window_size ** 2)
        masked = float('-inf')
    else:
        mask = torch.ones(window_size ** 2, window_size ** 2)
        masked = 0

    if upper_lower:
        mask[-displacement * window_size:, :-displacement * window_size] = masked
        mask[:-displacement * window_size, -displacement * window_size:] = masked

    if left_right:
        mask = mask.view(window_size, window_size, window_size, window_size)  # '(h1 w1) (h2 w2) -> h1 w1 h2 w2'
        mask[:, -displacement:, :, :-displacement] = masked
        mask[:, :-displacement, :, -displacement:] = masked
        mask = mask.reshape(window_size ** 2, window_size ** 2)  # 'h1 w1 h2 w2 -> (h1 w1) (h2 w2)'

    return mask


class WindowAttention(nn.Module):
    def __init__(self, dim, heads, dim_head, shifted, window_size=7):
        super().__init__()
        inner_dim = dim_head * heads

        self.heads = heads
        self.scale = dim_head ** -0.5
        self.window_size = window_size
        self.shifted = shifted

        if self.shifted:
            displacement = window_size // 2
            self.displacement = displacement
            self.cyclic_shift = CyclicShift(-displacement)
            self.cyclic_back_shift = CyclicShift(displacement)
            self.upper_lower_mask = nn.Parameter(create_mask(window_size=window_size, displacement=displacement,
                                                             upper_lower=True, left_right=False), requires_grad=False)
            self.left_right_mask = nn.Parameter(create_mask(window_size=window_size, displacement=displacement,
                                                            upper_lower=False, left_right=True), requires_grad=False)

        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.pos_embedding = nn.Parameter(torch.randn(self.window_size ** 2, self.window_size ** 2))
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x):
        if self.shifted:
            x = self.cyclic_shift(x)

        b, n, _, _, h = *x.shape, self.heads
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        nw_h = nw_w = n // self.window_size

        q, k, v = map(lambda t: to_windows(t, h, self.window_size), qkv)

        dots = einsum('b h w i d, b h w j d -> b h w i j', q, k) * self.scale
        dots += self.pos_embedding

        if self.shifted:
            if FIXED:
                dots[:, :, -nw_h:] += self.upper_lower_mask
                dots[:, :, nw_h - 1::nw_h] += self.left_right_mask
            else:
                dots[:, :, -nw_h:] *= self.upper_lower_mask
                dots[:, :, nw_h - 1::nw_h] *= self.left_right_mask

        attn = dots.softmax(dim=-1)

        out = einsum('b h w i j, b h w j d -> b h w i d', attn, v)
        out = from_windows(out, h, self.window_size, nw_h, nw_w)
        out = self.to_out(out)

        if self.shifted:
            x = self.cyclic_back_shift(x)
        return out


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, dim_head, mlp_dim, shifted):
        super().__init__()
        self.attention_block = Residual(
            PreNorm(dim, WindowAttention(dim=dim, heads=heads, dim_head=dim_head, shifted=shifted)))
        self.mlp_block = Residual(PreNorm(dim, FeedForward(dim=dim, hidden_dim=mlp_dim)))

    def forward(self, x):
        x = self.attention_block(x)
        x = self.mlp_block(x)
        return x


class PatchMerging(nn.Module):
    def __init__(self, in_channels, out_channels, downscaling_factor):
        super().__init__()
        self.downscaling_factor = downscaling_factor
        self.patch_merge = nn.Unfold(kernel_size=downscaling_factor, stride=downscaling_factor, padding=0)
        self.linear = nn.Linear(in_channels * downscaling_factor ** 2, out_channels)

    def forward(self, x):
        b, c, h, w = x.shape
        new_h, new_w = h // self.downscaling_factor, w // self.downscaling_factor
        x = self.patch_merge(x).view(b, -1, new_h, new_w).permute(0, 2, 3, 1)
        x = self.linear(x)
        return x


class StageModule(nn.Module):
    def __init__(self, in_channels, hidden_dimension, layers, downscaling_factor, num_heads):
        super().__init__()
        assert layers % 2 == 0, 'Stage layers need to be divisible by 2 for regular and shifted block.'
        self.patch_partition = PatchMerging(in_channels=in_channels, out_channels=hidden_dimension,
                                            downscaling_factor=downscaling_factor)
        self.layers = nn.ModuleList([])
        for _ in range(layers // 2):
            self.layers.append(nn.ModuleList([
                SwinBlock(dim=hidden_dimension, heads=num_heads, dim_head=32, mlp_dim=hidden_dimension * 4,
                          shifted=False),
                SwinBlock(dim=hidden_dimension, heads=num_heads, dim_head=32, mlp_dim=hidden_dimension * 4,
                          shifted=True),
            ]))

    def forward(self, x):
        x = self.patch_partition(x)
        for regular_block, shifted_block in self.layers:
            x = regular_block(x)
            x = shifted_block(x)
        return x.permute(0, 3, 1, 2)


class SwinTransformer(nn.Module):
    def __init__(self, *, num_classes, hidden_dim, layers, heads, channels=3):
        super().__init__()
        self.stage1 = StageModule(in_channels=channels, hidden_dimension=hidden_dim, layers=layers[0],
                                  downscaling_factor=4, num_heads=heads[0])
        self.stage2 = StageModule(in_channels=hidden_dim, hidden_dimension=hidden_dim * 2, layers=layers[1],
                                  downscaling_factor=2, num_heads=heads[1])
        self.stage3 = StageModule(in_channels=hidden_dim * 2, hidden_dimension=hidden_dim * 4, layers=layers[2],
                                  downscaling_factor=2, num_heads=heads[2])
        self.stage4 = StageModule(in_channels=hidden_dim * 4, hidden_dimension=hidden_dim * 8, layers=layers[3],
                                  downscaling_factor=2, num_heads=heads[3])
        self.mlp_head = nn.Sequential(nn.LayerNorm(hidden_dim * 8), nn.Linear(hidden_dim * 8, num_classes))

    def forward(self, img):
        x = self.stage1(img)
        x = self.stage2(x)
        x = self.stage3(x)
        x = self.stage4(x)
        x = x.mean(dim=[2, 3])
        return self.mlp_head(x)


# ---- reference: per-token loop over the keys a shifted window may attend to ----
def reference_shifted_attention(attn_mod, x):
    """Same weights; on the cyclically shifted grid each token attends only to tokens of its own window that come
    from the same side of the wrap-around (bottom `displacement` rows / right `displacement` columns)."""
    ws, d_, h = attn_mod.window_size, attn_mod.displacement, attn_mod.heads
    xs = torch.roll(x, shifts=(-d_, -d_), dims=(1, 2))
    b, n, _, _ = xs.shape
    q, k, v = attn_mod.to_qkv(xs).chunk(3, dim=-1)
    q, k, v = (t.reshape(b, n * n, h, -1) for t in (q, k, v))
    rr, cc = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    rr, cc = rr.reshape(-1), cc.reshape(-1)
    win = (rr // ws) * (n // ws) + cc // ws
    region = (rr >= n - d_).long() * 2 + (cc >= n - d_).long()
    allowed = (win[:, None] == win[None, :]) & (region[:, None] == region[None, :])
    local = (rr % ws) * ws + cc % ws
    bias = attn_mod.pos_embedding[local[:, None], local[None, :]]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * attn_mod.scale + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(b, n, n, -1)
    return attn_mod.to_out(out)


net = SwinTransformer(num_classes=3, hidden_dim=16, layers=(2, 2, 2, 2), heads=(1, 2, 2, 4), channels=3).eval()
captured = {}
shifted_attn = net.stage1.layers[0][1].attention_block.fn.fn
shifted_attn.register_forward_hook(lambda m, inp, out: captured.update(inp=inp[0], out=out))
with torch.no_grad():
    logits = net(torch.randn(2, 3, 224, 224))  # stage 1: 56x56 tokens -> 8x8 windows of 7x7
    ref = reference_shifted_attention(shifted_attn, captured["inp"])
print(f"stage-1 shifted WindowAttention vs per-token shifted-window reference: max |diff| = "
      f"{(captured['out'] - ref).abs().max().item():.6f}")
