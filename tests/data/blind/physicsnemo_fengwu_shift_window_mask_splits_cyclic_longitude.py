"""PhysicsNeMo FengWu/Pangu: the shifted-window mask cuts the cyclic longitude axis.

Citation: NVIDIA/physicsnemo#1599 ("Shifted-window attention mask incorrectly partitions the
cyclic longitude axis (Pangu, FengWu)"); fix proposed in PR #1826 (commit 41c0911, and the
earlier PR #1600, commit cbb400c). Both PRs were closed rather than merged as far as the stored
history shows (main still has the old function), so `--fixed` applies the PR's diff.

Bug: `get_shift_window_mask` (physicsnemo/nn/module/utils/shift_window_mask.py) labels regions
along latitude AND longitude, on an `img_mask` widened to `Lon + shift_lon` and then cropped.
After `Transformer2DBlock` rolls the grid by `-shift_lon`, the last longitude window holds the
columns just west of the dateline next to the columns just east of it; they are physically
adjacent, and the function's own docstring says such half windows "are directly merged into one
window", but the longitude labels give them different region ids, so they are masked (-100)
from each other. Fix: only the non-cyclic axis (latitude here) is partitioned; every longitude
window carries the same latitude regions.

This program is FengWu's 2D path: `Transformer2DBlock` (roll, `window_partition`,
`EarthAttention2D` with the earth position bias and the mask added to `q @ k.T` before the
softmax, `window_reverse`, roll back) on a 8 x 16 lat-lon grid, window (4, 8), shift (2, 4).
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def window_partition(x, window_size):
    B, Lat, Lon, C = x.shape
    win_lat, win_lon = window_size
    x = x.view(B, Lat // win_lat, win_lat, Lon // win_lon, win_lon, C)
    return x.permute(0, 3, 1, 2, 4, 5).contiguous().view(-1, (Lat // win_lat), win_lat, win_lon, C)


def window_reverse(windows, window_size, Lat=1, Lon=1):
    win_lat, win_lon = window_size
    B = int(windows.shape[0] / (Lon / win_lon))
    x = windows.view(B, Lon // win_lon, Lat // win_lat, win_lat, win_lon, -1)
    return x.permute(0, 2, 3, 1, 4, 5).contiguous().view(B, Lat, Lon, -1)


def get_earth_position_index(window_size):
    win_lat, win_lon = window_size
    coords_hi = torch.arange(win_lat)
    coords_hj = -torch.arange(win_lat) * win_lat
    coords_w = torch.arange(win_lon)
    coords_1 = torch.stack(torch.meshgrid([coords_hi, coords_w], indexing="ij"))
    coords_2 = torch.stack(torch.meshgrid([coords_hj, coords_w], indexing="ij"))
    coords = torch.flatten(coords_1, 1)[:, :, None] - torch.flatten(coords_2, 1)[:, None, :]
    coords = coords.permute(1, 2, 0).contiguous()
    coords[:, :, 1] += win_lon - 1
    coords[:, :, 0] *= 2 * win_lon - 1
    return coords.sum(-1)


def get_shift_window_mask(input_resolution, window_size, shift_size):
    """Along longitude the leftmost and rightmost indices are close to each other: half windows
    at both ends are merged into one window."""
    Lat, Lon = input_resolution
    win_lat, win_lon = window_size
    if FIXED:
        shift_lat, _ = shift_size
        img_mask = torch.zeros((1, Lat, Lon, 1))
    else:
        shift_lat, shift_lon = shift_size
        img_mask = torch.zeros((1, Lat, Lon + shift_lon, 1))
    lat_slices = (slice(0, -win_lat), slice(-win_lat, -shift_lat), slice(-shift_lat, None))
    cnt = 0
    if FIXED:
        for lat in lat_slices:
            img_mask[:, lat, :, :] = cnt
            cnt += 1
    else:
        lon_slices = (slice(0, -win_lon), slice(-win_lon, -shift_lon), slice(-shift_lon, None))
        for lat in lat_slices:
            for lon in lon_slices:
                img_mask[:, lat, lon, :] = cnt
                cnt += 1
        img_mask = img_mask[:, :, :Lon, :]
    mask_windows = window_partition(img_mask, window_size)  # n_lon, n_lat, win_lat, win_lon, 1
    mask_windows = mask_windows.view(mask_windows.shape[0], mask_windows.shape[1], win_lat * win_lon)
    attn_mask = mask_windows.unsqueeze(2) - mask_windows.unsqueeze(3)
    return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))


class EarthAttention2D(nn.Module):
    def __init__(self, dim, input_resolution, window_size, num_heads):
        super().__init__()
        self.window_size = window_size
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.type_of_windows = input_resolution[0] // window_size[0]
        self.earth_position_bias_table = nn.Parameter(
            torch.zeros((window_size[0] ** 2) * (window_size[1] * 2 - 1), self.type_of_windows, num_heads)
        )
        self.register_buffer("earth_position_index", get_earth_position_index(window_size))
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        torch.nn.init.trunc_normal_(self.earth_position_bias_table, std=0.02)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x, mask=None):
        B_, nW_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, nW_, N, 3, self.num_heads, C // self.num_heads).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        wl = self.window_size[0] * self.window_size[1]
        earth_position_bias = self.earth_position_bias_table[self.earth_position_index.view(-1)].view(
            wl, wl, self.type_of_windows, -1
        )
        attn = attn + earth_position_bias.permute(3, 2, 0, 1).contiguous().unsqueeze(0)
        if mask is not None:
            nLon = mask.shape[0]
            attn = attn.view(B_ // nLon, nLon, self.num_heads, nW_, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, nW_, N, N)
        attn = self.softmax(attn)
        x = (attn @ v).permute(0, 2, 3, 1, 4).reshape(B_, nW_, N, C)
        return self.proj(x)


class Transformer2DBlock(nn.Module):
    def __init__(self, dim, input_resolution, num_heads, window_size=(4, 8), shift_size=(2, 4)):
        super().__init__()
        self.input_resolution = input_resolution
        self.window_size = window_size
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = EarthAttention2D(dim, input_resolution, window_size, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        shift_lat, shift_lon = self.shift_size
        self.roll = shift_lon and shift_lat
        attn_mask = get_shift_window_mask(input_resolution, window_size, shift_size) if self.roll else None
        self.register_buffer("attn_mask", attn_mask)

    def forward(self, x):
        Lat, Lon = self.input_resolution
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).view(B, Lat, Lon, C)
        shift_lat, shift_lon = self.shift_size
        shifted_x = torch.roll(x, shifts=(-shift_lat, -shift_lon), dims=(1, 2)) if self.roll else x
        x_windows = window_partition(shifted_x, self.window_size)
        win_lat, win_lon = self.window_size
        x_windows = x_windows.view(x_windows.shape[0], x_windows.shape[1], win_lat * win_lon, C)
        attn_windows = self.attn(x_windows, mask=self.attn_mask)
        attn_windows = attn_windows.view(attn_windows.shape[0], attn_windows.shape[1], win_lat, win_lon, C)
        shifted_x = window_reverse(attn_windows, self.window_size, Lat=Lat, Lon=Lon)
        x = torch.roll(shifted_x, shifts=(shift_lat, shift_lon), dims=(1, 2)) if self.roll else shifted_x
        x = shortcut + x.reshape(B, Lat * Lon, C)
        return x + self.mlp(self.norm2(x))


def main():
    torch.manual_seed(0)
    Lat, Lon, C = 8, 16, 32
    blocks = nn.Sequential(
        Transformer2DBlock(C, (Lat, Lon), num_heads=4, window_size=(4, 8), shift_size=(0, 0)),
        Transformer2DBlock(C, (Lat, Lon), num_heads=4, window_size=(4, 8), shift_size=(2, 4)),
    ).eval()
    x = torch.randn(2, Lat * Lon, C)
    with torch.no_grad():
        y = blocks(x)
    print("fengwu blocks out", tuple(y.shape), "%.4f" % y.abs().mean().item())


if __name__ == "__main__":
    main()
