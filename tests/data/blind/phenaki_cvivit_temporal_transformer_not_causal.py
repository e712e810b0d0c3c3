# lucidrains/phenaki-pytorch#42: C-ViViT (causal video tokenizer) built its temporal transformer without
# causal = True, so the tokens of early frames attended to (and were encoded from) later frames.
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=2, causal=False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.scale = dim_head ** -0.5
        inner = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.heads
        x = self.norm(x)
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q, k, v = (t.reshape(b, n, h, -1).transpose(1, 2) for t in (q, k, v))
        q = q * self.scale
        sim = einsum('b h i d, b h j d -> b h i j', q, k)
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, depth, dim_head=16, heads=2, causal=False):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim, dim_head=dim_head, heads=heads, causal=causal),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim)),
            ]))
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, x):
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.norm_out(x)


class CViViT(nn.Module):
    def __init__(self, dim, patch_size, temporal_patch_size, spatial_depth, temporal_depth, channels=3):
        super().__init__()
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.to_image_tokens = nn.Linear(channels * patch_size * patch_size, dim)
        self.to_tubelet_tokens = nn.Linear(channels * temporal_patch_size * patch_size * patch_size, dim)
        self.enc_spatial_transformer = Transformer(dim=dim, depth=spatial_depth)
        if FIXED:
            self.enc_temporal_transformer = Transformer(dim=dim, depth=temporal_depth, causal=True)
        else:
            self.enc_temporal_transformer = Transformer(dim=dim, depth=temporal_depth)

    def patchify(self, video, tp):
        b, c, f, H, W = video.shape
        p = self.patch_size
        x = video.reshape(b, c, f // tp, tp, H // p, p, W // p, p)
        x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # b t h w (c pt p1 p2)
        return x.reshape(b, f // tp, H // p, W // p, -1)

    def encode(self, tokens):
        b, t, h, w, d = tokens.shape
        tokens = tokens.reshape(b * t, h * w, d)                      # attend within a frame
        tokens = self.enc_spatial_transformer(tokens)
        tokens = tokens.reshape(b, t, h, w, d).permute(0, 2, 3, 1, 4).reshape(b * h * w, t, d)
        tokens = self.enc_temporal_transformer(tokens)                # attend across time
        return tokens.reshape(b, h, w, t, d).permute(0, 3, 1, 2, 4)

    def forward(self, video):
        first_frame, rest_frames = video[:, :, :1], video[:, :, 1:]
        first_tokens = self.to_image_tokens(self.patchify(first_frame, 1))
        rest_tokens = self.to_tubelet_tokens(self.patchify(rest_frames, self.temporal_patch_size))
        tokens = torch.cat((first_tokens, rest_tokens), dim=1)
        return self.encode(tokens)


def main():
    torch.manual_seed(0)
    cvivit = CViViT(dim=32, patch_size=4, temporal_patch_size=2, spatial_depth=1, temporal_depth=2).eval()
    video = torch.randn(1, 3, 7, 8, 8)  # first frame + 6 frames -> 4 time steps
    with torch.no_grad():
        z = cvivit(video)
        video2 = video.clone()
        video2[:, :, -2:] = torch.randn(1, 3, 2, 8, 8)  # change only the last tubelet
        z2 = cvivit(video2)
    leak = (z[:, :-1] - z2[:, :-1]).abs().max().item()
    print(f"change of earlier-time tokens after editing the last frames: {leak:.3e}")


if __name__ == "__main__":
    main()
