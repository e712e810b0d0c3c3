# Citation: huggingface/candle#2286 ("Positional encoding in DINOv2: Case without interpolation"),
#   fixed by huggingface/candle#3172 (commit 836540fd4, "Fix DINOv2 no-interpolation shortcut");
#   candle-transformers/src/models/dinov2.rs read at 836540fd4^ and 836540fd4; Rust/candle ported to torch.
# Where: DinoVisionTransformer::interpolate_pos_encoding and prepare_tokens_with_mask.
# Bug: when the image has the model's own patch grid (npatch == n and w == h) the shortcut returns
#   `xs.clone()` (the tokens themselves) instead of the position table, so prepare_tokens_with_mask
#   computes xs + xs: every patch and the class token enter the blocks with no positions at all (and doubled).
#   Images of another size take the interpolation path and do get positions.
# Fix: the shortcut returns `self.pos_embed.clone()`.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# tiny sizes (candle: IMG_SIZE = 518, PATCH_SIZE = 14, NUM_CLASSES = 1000)
IMG_SIZE = 28
PATCH_SIZE = 7
NUM_CLASSES = 10


class Attention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=True, proj_bias=True):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.output = nn.Linear(dim, dim, bias=proj_bias)
        self.num_heads = num_heads
        self.scale = 1.0 / ((dim // num_heads) ** 0.5)

    def forward(self, xs):
        b, n, c = xs.shape
        qkv = (
            self.qkv(xs)
            .reshape(b, n, 3, self.num_heads, c // self.num_heads)
            .transpose(1, 2)  # 02134
            .transpose(0, 1)  # 20134
            .transpose(2, 3)  # 20314
        )
        q = qkv[0] * self.scale
        k = qkv[1].contiguous()
        v = qkv[2].contiguous()
        attn = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        attn = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.output(attn)


class LayerScale(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, xs):
        return xs * self.lambda1


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)

    def forward(self, xs):
        return self.fc2(F.gelu(self.fc1(xs)))


class Block(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = Attention(dim, num_heads, True, True)
        self.ls1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = Mlp(dim, dim * 4, True)
        self.ls2 = LayerScale(dim)

    def forward(self, xs):
        residual = xs
        xs = self.ls1(self.attn(self.norm1(xs)))
        xs = xs + residual
        residual = xs
        xs = self.ls2(self.mlp(self.norm2(xs)))
        return xs + residual


class PatchEmbed(nn.Module):
    def __init__(self, img_size, patch_size, in_chans, embed_dim):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)
        self.patch_size = (patch_size, patch_size)
        self.num_patches = (img_size // patch_size) * (img_size // patch_size)

    def forward(self, xs):
        _b, _c, h, w = xs.shape
        patch_h, patch_w = self.patch_size
        if h % patch_h != 0 or w % patch_w != 0:
            raise ValueError(f"image {h}x{w} is not a multiple of the patch size {patch_h}")
        xs = self.proj(xs)
        b, c, h, w = xs.shape
        # flatten embeddings.
        return xs.reshape(b, c, h * w).transpose(1, 2)


class DinoVisionTransformer(nn.Module):
    def __init__(self, depth, embed_dim, num_heads):
        super().__init__()
        self.patch_embed = PatchEmbed(IMG_SIZE, PATCH_SIZE, 3, embed_dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        num_tokens = 1
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + num_tokens, embed_dim))
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-5)
        self.head = nn.Linear(2 * embed_dim, NUM_CLASSES)

    def interpolate_pos_encoding(self, xs, w, h):
        npatch = xs.shape[1] - 1
        n = self.pos_embed.shape[1] - 1
        sqrt_n = n ** 0.5
        if npatch == n and w == h:
            if FIXED:
                return self.pos_embed.clone()
            return xs.clone()
        class_pos_embed = self.pos_embed[:, :1]
        patch_pos_embed = self.pos_embed[:, 1:]
        dim = xs.shape[-1]
        w0, h0 = (w // PATCH_SIZE) + 0.1, (h // PATCH_SIZE) + 0.1
        patch_pos_embed = (
            patch_pos_embed.reshape(1, int(sqrt_n), int(sqrt_n), dim).transpose(2, 3).transpose(1, 2)
        )
        # This uses bicubic interpolation in the original implementation.
        patch_pos_embed = F.interpolate(patch_pos_embed, size=(int(h0), int(w0)), mode="nearest")
        el_count = patch_pos_embed.numel()
        patch_pos_embed = patch_pos_embed.transpose(1, 2).transpose(2, 3).reshape(1, el_count // dim, dim)
        return torch.cat([class_pos_embed, patch_pos_embed], dim=1)

    def prepare_tokens_with_mask(self, xs):
        _b, _nc, w, h = xs.shape
        xs = self.patch_embed(xs)
        xs = torch.cat([self.cls_token, xs], dim=1)
        return xs + self.interpolate_pos_encoding(xs, w, h)

    def forward(self, xs):
        xs = self.prepare_tokens_with_mask(xs)
        for blk in self.blocks:
            xs = blk(xs)
        xs = self.norm(xs)
        xs_norm_clstoken = xs[:, 0]
        xs_norm_patchtokens = xs[:, 1:].mean(1)
        xs = torch.cat([xs_norm_clstoken, xs_norm_patchtokens], dim=-1)
        return self.head(xs)


def vit_small():
    return DinoVisionTransformer(2, 32, 4)


def main():
    model = vit_small().eval()
    # the candle example feeds one image at a time (its cls_token is concatenated unexpanded)
    images = {
        "native 28x28": torch.rand(1, 3, IMG_SIZE, IMG_SIZE),
        "resized 42x42": torch.rand(1, 3, 42, 42),
    }
    with torch.no_grad():
        for name, img in images.items():
            logits = model(img)
            probs = torch.softmax(logits, dim=-1)[0]
            top = torch.topk(probs, 3)
            print(f"{name}: top-3 classes {top.indices.tolist()} probs {[round(p, 4) for p in top.values.tolist()]}")
            print(f"  logits {[round(v, 4) for v in logits[0].tolist()]}")


if __name__ == "__main__":
    main()
