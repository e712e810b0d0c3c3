"""SRFormer PSA_Block: the shifted-window mask for the permuted (2x2-compressed) keys uses the wrong slices.

Citation: HVision-NKU/SRFormer#14 ("fix shift_size for the permuted_window_mask", merged;
commit bc85758). Read from the upstream git history (basicsr/archs/srformer_arch.py before and
after bc85758).

Bug: ``calculate_mask`` labels the shifted image regions twice -- once on the full-resolution
window grid (queries) and once on the half-resolution permuted grid (keys, each a 2x2 merge).
For the permuted grid it used ``slice(-permuted_window_size, -shift_size)`` for rows and
``slice(-permuted_window_size, -permuted_window_size)`` for columns. With
permuted_window_size == shift_size == window_size // 2 both middle slices are empty, so the key
regions get the wrong labels: in the border windows queries are masked from keys of their own
region and allowed keys that came from the other side of the cyclic roll (the PR: 15/64 of the
pixels of a 64x64 input with window 16 lose their attention).

Fix: on the half-resolution grid the shift is ``shift_size // 2``:
``slice(-permuted_window_size, -shift_size // 2), slice(-shift_size // 2, None)`` for rows and
columns.

This program: one PSA_Block (window 8, shift 4, 16x16 feature map, dim 16) with PSA's q / 2x2-
compressed kv attention and the additive (0 / -100) mask over softmax, as upstream; the relative
position bias table is left out.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def window_partition(x, window_size):
    b, h, w, c = x.shape
    x = x.view(b, h // window_size, window_size, w // window_size, window_size, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, c)


def window_reverse(windows, window_size, h, w):
    b = int(windows.shape[0] / (h * w / window_size / window_size))
    x = windows.view(b, h // window_size, w // window_size, window_size, window_size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, w, -1)


class PSA(nn.Module):
    """Permuted self-attention: full-resolution queries, 2x2-merged keys/values."""

    def __init__(self, dim, window_size, num_heads):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.permuted_window_size = (window_size[0] // 2, window_size[1] // 2)
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.kv = nn.Linear(dim, dim // 2)
        self.q = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x, mask=None):
        b_, n, c = x.shape
        pw = self.permuted_window_size
        kv = self.kv(x).reshape(b_, pw[0], 2, pw[1], 2, 2, c // 4).permute(0, 1, 3, 5, 2, 4, 6) \
            .reshape(b_, n // 4, 2, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        q = self.q(x).reshape(b_, n, 1, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)[0]
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)  # (num_windows*b, num_heads, n, n//4)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(b_ // nw, nw, self.num_heads, n, n // 4) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, n, n // 4)
            attn = self.softmax(attn)
        else:
            attn = self.softmax(attn)
        x = (attn @ v).transpose(1, 2).reshape(b_, n, c)
        return self.proj(x)


class PSA_Block(nn.Module):
    def __init__(self, dim, input_resolution, num_heads, window_size=8, shift_size=0):
        super().__init__()
        self.dim = dim
        self.input_resolution = input_resolution
        self.window_size = window_size
        self.permuted_window_size = window_size // 2
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = PSA(dim, window_size=(window_size, window_size), num_heads=num_heads)
        attn_mask = self.calculate_mask(self.input_resolution) if self.shift_size > 0 else None
        self.register_buffer("attn_mask", attn_mask)

    def calculate_mask(self, x_size):
        # calculate mask for original windows
        h, w = x_size
        img_mask = torch.zeros((1, h, w, 1))  # 1 h w 1
        h_slices = (slice(0, -self.window_size), slice(-self.window_size, -self.shift_size),
                    slice(-self.shift_size, None))
        w_slices = (slice(0, -self.window_size), slice(-self.window_size, -self.shift_size),
                    slice(-self.shift_size, None))
        cnt = 0
        for hs in h_slices:
            for ws in w_slices:
                img_mask[:, hs, ws, :] = cnt
                cnt += 1
        mask_windows = window_partition(img_mask, self.window_size)
        mask_windows = mask_windows.view(-1, self.window_size * self.window_size)
        # calculate mask for permuted windows
        permuted_window_mask = torch.zeros((1, h // 2, w // 2, 1))  # 1 h w 1
        if FIXED:
            h_slices = (slice(0, -self.permuted_window_size), slice(-self.permuted_window_size, -self.shift_size // 2),
                        slice(-self.shift_size // 2, None))
            w_slices = (slice(0, -self.permuted_window_size), slice(-self.permuted_window_size, -self.shift_size // 2),
                        slice(-self.shift_size // 2, None))
        else:
            h_slices = (slice(0, -self.permuted_window_size), slice(-self.permuted_window_size, -self.shift_size),
                        slice(-self.shift_size, None))
            w_slices = (slice(0, -self.permuted_window_size), slice(-self.permuted_window_size, -self.permuted_window_size),
                        slice(-self.permuted_window_size, None))
        cnt = 0
        for hs in h_slices:
            for ws in w_slices:
                permuted_window_mask[:, hs, ws, :] = cnt
                cnt += 1
        permuted_windows = window_partition(permuted_window_mask, self.permuted_window_size)
        permuted_windows = permuted_windows.view(-1, self.permuted_window_size * self.permuted_window_size)
        # calculate attention mask
        attn_mask = mask_windows.unsqueeze(2) - permuted_windows.unsqueeze(1)
        attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))
        return attn_mask

    def forward(self, x, x_size):
        h, w = x_size
        b, _, c = x.shape
        shortcut = x
        x = self.norm1(x).view(b, h, w, c)
        if self.shift_size > 0:
            shifted_x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        else:
            shifted_x = x
        x_windows = window_partition(shifted_x, self.window_size).view(-1, self.window_size * self.window_size, c)
        if self.input_resolution == x_size:
            attn_windows = self.attn(x_windows, mask=self.attn_mask)
        else:
            attn_windows = self.attn(x_windows, mask=self.calculate_mask(x_size).to(x.device))
        attn_windows = attn_windows.view(-1, self.window_size, self.window_size, c)
        shifted_x = window_reverse(attn_windows, self.window_size, h, w)
        if self.shift_size > 0:
            x = torch.roll(shifted_x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        else:
            x = shifted_x
        return shortcut + x.view(b, h * w, c)


def main():
    torch.manual_seed(0)
    x_size = (16, 16)
    block = PSA_Block(dim=16, input_resolution=x_size, num_heads=2, window_size=8, shift_size=4).eval()
    x = torch.randn(1, 16 * 16, 16)
    with torch.no_grad():
        y = block(x, x_size)
    print(f"SW-PSA masked cells per window {(block.attn_mask != 0).sum((1, 2)).tolist()} out norm {y.norm():.4f}")


if __name__ == "__main__":
    main()
