"""Correct: a vision encoder with axial 2-D rotary embeddings (as EVA-02 and FLUX-style image models rotate): the first
half of each head's width rotated by a patch's row, the second half by its column, queries and keys alike, over a
3 x 4 and a 4 x 4 grid; bidirectional SDPA. Two rotations of one call that differ token to token, not one shift.
Written for tests/test_checks_rotatedkeys.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class AxialRotary(nn.Module):
    def __init__(self, head_dim, base=100.0):
        super().__init__()
        quarter = head_dim // 4
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(quarter).float() / quarter), persistent=False)

    def table(self, positions):
        freqs = positions[:, None].float() * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]

    def forward(self, x, rows, cols):
        half = x.shape[-1] // 2
        xr, xc = x[..., :half], x[..., half:]
        cos_r, sin_r = self.table(rows)
        cos_c, sin_c = self.table(cols)
        xr = xr * cos_r + rotate_half(xr) * sin_r
        xc = xc * cos_c + rotate_half(xc) * sin_c
        return torch.cat((xr, xc), dim=-1)


class Block(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rope = AxialRotary(self.head_dim)

    def forward(self, x, rows, cols):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q, rows, cols), self.rope(k, rows, cols)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(y.transpose(1, 2).reshape(b, n, -1))


class Encoder(nn.Module):
    def __init__(self, dim=32, depth=2, patch=4):
        super().__init__()
        self.patch = patch
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, images):
        x = self.embed(images)
        h, w = x.shape[-2:]
        grid = torch.arange(h * w)
        rows, cols = grid // w, grid % w
        x = x.flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, rows, cols)
        return x.mean(1)


model = Encoder().eval()
with torch.no_grad():
    for size in ((12, 16), (16, 16)):
        print(size, model(torch.randn(2, 3, *size)).sum().item())
