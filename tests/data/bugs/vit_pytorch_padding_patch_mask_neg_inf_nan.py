"""vit-pytorch: masking padding patches with float('-inf') turns the whole output into NaN.

Citation: lucidrains/vit-pytorch#26 ("Masking Patches Question": with padding patches masked the
output is [nan, nan]); fixed by commit 6c8dfc1 ("remove float(-inf) as masking value", v0.2.7).

Bug: Attention.forward builds a query-and-key mask ``mask[:, None, :] * mask[:, :, None]`` from
the patch mask (CLS prepended as True) and fills it with float('-inf'). The row of every padding
patch is then all -inf, softmax gives NaN there, and in the next layer the real tokens' attention
(weight 0 on those keys) times their NaN values is NaN again - the CLS token and the logits are
NaN for every image that has padding patches.
Fix: fill with ``-torch.finfo(dots.dtype).max`` so a fully masked row is finite.

Reproduction: the ViT of that version (einops written out), 8x8 images of 2x2 patches (16 patches,
MIN_NUM_PATCHES lowered accordingly), one image whose bottom half (8 patches) is marked False in the mask.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

MIN_NUM_PATCHES = 8


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
    def __init__(self, dim, hidden_dim, dropout=0.):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden_dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dropout=0.):
        super().__init__()
        self.heads = heads
        self.scale = dim ** -0.5
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(dropout))

    def forward(self, x, mask=None):
        b, n, _, h = *x.shape, self.heads
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.view(b, n, h, -1).transpose(1, 2), qkv)  # 'b n (h d) -> b h n d'

        dots = torch.einsum('bhid,bhjd->bhij', q, k) * self.scale
        mask_value = -torch.finfo(dots.dtype).max if FIXED else float('-inf')

        if mask is not None:
            mask = F.pad(mask.flatten(1), (1, 0), value=True)
            assert mask.shape[-1] == dots.shape[-1], 'mask has incorrect dimensions'
            mask = mask[:, None, :] * mask[:, :, None]
            dots.masked_fill_(~mask, mask_value)
            del mask

        attn = dots.softmax(dim=-1)
        out = torch.einsum('bhij,bhjd->bhid', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, depth, heads, mlp_dim, dropout):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Residual(PreNorm(dim, Attention(dim, heads=heads, dropout=dropout))),
                Residual(PreNorm(dim, FeedForward(dim, mlp_dim, dropout=dropout))),
            ]))

    def forward(self, x, mask=None):
        for attn, ff in self.layers:
            x = attn(x, mask=mask)
            x = ff(x)
        return x


class ViT(nn.Module):
    def __init__(self, *, image_size, patch_size, num_classes, dim, depth, heads, mlp_dim, channels=3,
                 dropout=0., emb_dropout=0.):
        super().__init__()
        assert image_size % patch_size == 0, 'image dimensions must be divisible by the patch size'
        num_patches = (image_size // patch_size) ** 2
        patch_dim = channels * patch_size ** 2
        assert num_patches > MIN_NUM_PATCHES, 'your number of patches is way too small'
        self.patch_size = patch_size
        self.pos_embedding = nn.Parameter(torch.randn(1, num_patches + 1, dim))
        self.patch_to_embedding = nn.Linear(patch_dim, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.dropout = nn.Dropout(emb_dropout)
        self.transformer = Transformer(dim, depth, heads, mlp_dim, dropout)
        self.to_cls_token = nn.Identity()
        self.mlp_head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout),
                                      nn.Linear(mlp_dim, num_classes))

    def forward(self, img, mask=None):
        p = self.patch_size
        b, c, H, W = img.shape
        # 'b c (h p1) (w p2) -> b (h w) (p1 p2 c)'
        x = img.view(b, c, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (H // p) * (W // p), -1)
        x = self.patch_to_embedding(x)
        b, n, _ = x.shape
        cls_tokens = self.cls_token.expand(b, -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        x += self.pos_embedding[:, :(n + 1)]
        x = self.dropout(x)
        x = self.transformer(x, mask)
        x = self.to_cls_token(x[:, 0])
        return self.mlp_head(x)


if __name__ == "__main__":
    torch.manual_seed(0)
    v = ViT(image_size=8, patch_size=2, num_classes=2, dim=32, depth=2, heads=4, mlp_dim=64).eval()
    # one 8x8 canvas holding a smaller image; (b, h/p, w/p) mask, True = real patch.
    # (The mask of that version broadcasts (b, n, n) against (b, heads, n, n), so it runs with b = 1.)
    img = torch.randn(1, 3, 8, 8)
    mask = torch.ones(1, 4, 4, dtype=torch.bool)
    mask[0, 2:, :] = False
    img[0, :, 4:, :] = 0.0
    with torch.no_grad():
        preds = v(img, mask=mask)
    print("preds", [[round(p, 4) for p in row] for row in preds.tolist()])
