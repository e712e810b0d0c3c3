# lucidrains/vit-pytorch commit c2b2db2: "fix window size of none for scalable vit for rectangular images"
# ScalableViT's InteractiveWindowedSelfAttention with window_size=None is meant to attend over the whole feature map,
# but it took `wsz = default(wsz, height)` and cut the map into height x height square windows, so on a rectangular
# map (width = k * height) each query only saw the keys of its own square block. The fix uses separate window sides
# `wsz_h, wsz_w = default(wsz, height), default(wsz, width)`, making the None window span the full H x W map.
import sys
from functools import partial

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# helpers

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

def cast_tuple(val, length = 1):
    return val if isinstance(val, tuple) else ((val,) * length)

# einops patterns written out with view / permute (einops is not installed here)

def split_heads_flat(t, heads):  # 'b (h d) ... -> b h (...) d'
    b, hd = t.shape[:2]
    return t.reshape(b, heads, hd // heads, -1).transpose(-1, -2)

def to_windows(t, heads, w1, w2):  # 'b (h d) (x w1) (y w2) -> (b x y) h (w1 w2) d'
    b, hd, H, W = t.shape
    d = hd // heads
    t = t.reshape(b, heads, d, H // w1, w1, W // w2, w2)
    t = t.permute(0, 3, 5, 1, 4, 6, 2)  # b x y h w1 w2 d
    return t.reshape(b * (H // w1) * (W // w2), heads, w1 * w2, d)

def from_windows(t, x, y, w1, w2):  # '(b x y) h (w1 w2) d -> b (h d) (x w1) (y w2)'
    bxy, heads, _, d = t.shape
    b = bxy // (x * y)
    t = t.reshape(b, x, y, heads, w1, w2, d).permute(0, 3, 6, 1, 4, 2, 5)  # b h d x w1 y w2
    return t.reshape(b, heads * d, x * w1, y * w2)

# helper classes

class ChanLayerNorm(nn.Module):
    def __init__(self, dim, eps = 1e-5):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))
        self.b = nn.Parameter(torch.zeros(1, dim, 1, 1))

    def forward(self, x):
        var = torch.var(x, dim = 1, unbiased = False, keepdim = True)
        mean = torch.mean(x, dim = 1, keepdim = True)
        return (x - mean) / (var + self.eps).sqrt() * self.g + self.b

class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = ChanLayerNorm(dim)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.norm(x))

class Downsample(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.conv = nn.Conv2d(dim_in, dim_out, 3, stride = 2, padding = 1)

    def forward(self, x):
        return self.conv(x)

class PEG(nn.Module):
    def __init__(self, dim, kernel_size = 3):
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, kernel_size = kernel_size, padding = kernel_size // 2, groups = dim, stride = 1)

    def forward(self, x):
        return self.proj(x) + x

class FeedForward(nn.Module):
    def __init__(self, dim, expansion_factor = 4, dropout = 0.):
        super().__init__()
        inner_dim = dim * expansion_factor
        self.net = nn.Sequential(
            nn.Conv2d(dim, inner_dim, 1),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Conv2d(inner_dim, dim, 1),
            nn.Dropout(dropout)
        )
    def forward(self, x):
        return self.net(x)

# attention

class ScalableSelfAttention(nn.Module):
    def __init__(self, dim, heads = 8, dim_key = 32, dim_value = 32, dropout = 0., reduction_factor = 1):
        super().__init__()
        self.heads = heads
        self.scale = dim_key ** -0.5
        self.attend = nn.Softmax(dim = -1)
        self.to_q = nn.Conv2d(dim, dim_key * heads, 1, bias = False)
        self.to_k = nn.Conv2d(dim, dim_key * heads, reduction_factor, stride = reduction_factor, bias = False)
        self.to_v = nn.Conv2d(dim, dim_value * heads, reduction_factor, stride = reduction_factor, bias = False)
        self.to_out = nn.Sequential(nn.Conv2d(dim_value * heads, dim, 1), nn.Dropout(dropout))

    def forward(self, x):
        height, width, heads = *x.shape[-2:], self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q, k, v = map(lambda t: split_heads_flat(t, heads), (q, k, v))
        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        attn = self.attend(dots)
        out = torch.matmul(attn, v)
        b, h, n, d = out.shape
        out = out.transpose(-1, -2).reshape(b, h * d, height, width)  # 'b h (x y) d -> b (h d) x y'
        return self.to_out(out)

class InteractiveWindowedSelfAttention(nn.Module):
    def __init__(self, dim, window_size, heads = 8, dim_key = 32, dim_value = 32, dropout = 0.):
        super().__init__()
        self.heads = heads
        self.scale = dim_key ** -0.5
        self.window_size = window_size
        self.attend = nn.Softmax(dim = -1)
        self.local_interactive_module = nn.Conv2d(dim_value * heads, dim_value * heads, 3, padding = 1)
        self.to_q = nn.Conv2d(dim, dim_key * heads, 1, bias = False)
        self.to_k = nn.Conv2d(dim, dim_key * heads, 1, bias = False)
        self.to_v = nn.Conv2d(dim, dim_value * heads, 1, bias = False)
        self.to_out = nn.Sequential(nn.Conv2d(dim_value * heads, dim, 1), nn.Dropout(dropout))

    def forward(self, x):
        height, width, heads, wsz = *x.shape[-2:], self.heads, self.window_size

        if FIXED:
            wsz_h, wsz_w = default(wsz, height), default(wsz, width)
        else:
            wsz = default(wsz, height) # take height as window size if not given
            wsz_h, wsz_w = wsz, wsz
        assert (height % wsz_h) == 0 and (width % wsz_w) == 0, f'height ({height}) or width ({width}) of feature map is not divisible by the window size ({wsz_h}, {wsz_w})'

        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)

        # get output of LIM
        local_out = self.local_interactive_module(v)

        # divide into window (and split out heads) for efficient self attention
        q, k, v = map(lambda t: to_windows(t, heads, wsz_h, wsz_w), (q, k, v))

        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        attn = self.attend(dots)
        self.last_keys_per_query = attn.shape[-1]
        out = torch.matmul(attn, v)

        # reshape the windows back to full feature map (and merge heads)
        out = from_windows(out, height // wsz_h, width // wsz_w, wsz_h, wsz_w)

        # add LIM output
        out = out + local_out
        return self.to_out(out)

class Transformer(nn.Module):
    def __init__(self, dim, depth, heads = 8, ff_expansion_factor = 4, dropout = 0., ssa_dim_key = 32, ssa_dim_value = 32,
                 ssa_reduction_factor = 1, iwsa_dim_key = 32, iwsa_dim_value = 32, iwsa_window_size = None, norm_output = True):
        super().__init__()
        self.layers = nn.ModuleList([])
        for ind in range(depth):
            is_first = ind == 0
            self.layers.append(nn.ModuleList([
                PreNorm(dim, ScalableSelfAttention(dim, heads = heads, dim_key = ssa_dim_key, dim_value = ssa_dim_value, reduction_factor = ssa_reduction_factor, dropout = dropout)),
                PreNorm(dim, FeedForward(dim, expansion_factor = ff_expansion_factor, dropout = dropout)),
                PEG(dim) if is_first else None,
                PreNorm(dim, FeedForward(dim, expansion_factor = ff_expansion_factor, dropout = dropout)),
                PreNorm(dim, InteractiveWindowedSelfAttention(dim, heads = heads, dim_key = iwsa_dim_key, dim_value = iwsa_dim_value, window_size = iwsa_window_size, dropout = dropout))
            ]))
        self.norm = ChanLayerNorm(dim) if norm_output else nn.Identity()

    def forward(self, x):
        for ssa, ff1, peg, iwsa, ff2 in self.layers:
            x = ssa(x) + x
            x = ff1(x) + x
            if exists(peg):
                x = peg(x)
            x = iwsa(x) + x
            x = ff2(x) + x
        return self.norm(x)

class ScalableViT(nn.Module):
    def __init__(self, *, num_classes, dim, depth, heads, reduction_factor, window_size = None, iwsa_dim_key = 32,
                 iwsa_dim_value = 32, ssa_dim_key = 32, ssa_dim_value = 32, ff_expansion_factor = 4, channels = 3, dropout = 0.):
        super().__init__()
        self.to_patches = nn.Conv2d(channels, dim, 7, stride = 4, padding = 3)
        assert isinstance(depth, tuple)
        num_stages = len(depth)
        dims = tuple(map(lambda i: (2 ** i) * dim, range(num_stages)))
        hyperparams_per_stage = [heads, ssa_dim_key, ssa_dim_value, reduction_factor, iwsa_dim_key, iwsa_dim_value, window_size]
        hyperparams_per_stage = list(map(partial(cast_tuple, length = num_stages), hyperparams_per_stage))
        self.layers = nn.ModuleList([])
        for ind, (layer_dim, layer_depth, layer_heads, layer_ssa_dim_key, layer_ssa_dim_value, layer_ssa_reduction_factor, layer_iwsa_dim_key, layer_iwsa_dim_value, layer_window_size) in enumerate(zip(dims, depth, *hyperparams_per_stage)):
            is_last = ind == (num_stages - 1)
            self.layers.append(nn.ModuleList([
                Transformer(dim = layer_dim, depth = layer_depth, heads = layer_heads, ff_expansion_factor = ff_expansion_factor, dropout = dropout, ssa_dim_key = layer_ssa_dim_key, ssa_dim_value = layer_ssa_dim_value, ssa_reduction_factor = layer_ssa_reduction_factor, iwsa_dim_key = layer_iwsa_dim_key, iwsa_dim_value = layer_iwsa_dim_value, iwsa_window_size = layer_window_size),
                Downsample(layer_dim, layer_dim * 2) if not is_last else None
            ]))
        self.mlp_head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], num_classes))

    def forward(self, img):
        x = self.to_patches(img)
        for transformer, downsample in self.layers:
            x = transformer(x)
            if exists(downsample):
                x = downsample(x)
        return self.mlp_head(x)


model = ScalableViT(
    num_classes = 10,
    dim = 16,
    heads = 2,
    depth = (1, 1),
    ssa_dim_key = 8, ssa_dim_value = 8, iwsa_dim_key = 8, iwsa_dim_value = 8,
    reduction_factor = (2, 1),
    window_size = (None, None),   # None: the interactive windowed attention should cover the whole map
    ff_expansion_factor = 2,
)

# one training step on a batch of wide (rectangular) images: feature maps 8x16, then 4x8
imgs = torch.randn(2, 3, 32, 64)
labels = torch.tensor([1, 7])
opt = torch.optim.SGD(model.parameters(), lr = 0.1)
logits = model(imgs)
loss = nn.functional.cross_entropy(logits, labels)
loss.backward()
opt.step()

iwsa = [m.fn for m in model.modules() if isinstance(m, PreNorm) and isinstance(m.fn, InteractiveWindowedSelfAttention)]
print("fixed" if FIXED else "buggy", "loss %.6f" % loss.item(), "iwsa keys per query:", [m.last_keys_per_query for m in iwsa])
