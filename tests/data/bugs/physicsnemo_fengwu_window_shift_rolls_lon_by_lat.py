# NVIDIA/physicsnemo#1492 (addresses #1399): the Pangu/FengWu shifted-window block rolled the longitude axis forward by
# shift_lat instead of shift_lon, so the shifted-window attention mask (built for shift_lon) no longer matched the tokens.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def window_partition(x, window_size):
    B, Lat, Lon, C = x.shape
    win_lat, win_lon = window_size
    x = x.view(B, Lat // win_lat, win_lat, Lon // win_lon, win_lon, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, win_lat * win_lon, C)


def window_reverse(windows, window_size, Lat, Lon):
    win_lat, win_lon = window_size
    B = int(windows.shape[0] / (Lat * Lon / win_lat / win_lon))
    x = windows.view(B, Lat // win_lat, Lon // win_lon, win_lat, win_lon, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, Lat, Lon, -1)


def get_shift_window_mask(input_resolution, window_size, shift_size):
    Lat, Lon = input_resolution
    win_lat, win_lon = window_size
    shift_lat, shift_lon = shift_size
    img_mask = torch.zeros((1, Lat, Lon + shift_lon, 1))
    lat_slices = (slice(0, -win_lat), slice(-win_lat, -shift_lat), slice(-shift_lat, None))
    lon_slices = (slice(0, -win_lon), slice(-win_lon, -shift_lon), slice(-shift_lon, None))
    cnt = 0
    for lat in lat_slices:
        for lon in lon_slices:
            img_mask[:, lat, lon, :] = cnt
            cnt += 1
    img_mask = img_mask[:, :, :Lon, :]
    mask_windows = window_partition(img_mask, window_size).squeeze(-1)  # nW, N
    attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
    attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))
    return attn_mask  # nW, N, N


class EarthAttention2D(nn.Module):
    def __init__(self, dim, input_resolution, window_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.type_of_windows = input_resolution[0] // window_size[0]
        N = window_size[0] * window_size[1]
        self.earth_position_bias = nn.Parameter(0.02 * torch.randn(self.type_of_windows, num_heads, N, N))
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        nW = mask.shape[0]
        n_lon = nW // self.type_of_windows
        bias = self.earth_position_bias.repeat_interleave(n_lon, dim=0)  # nW, H, N, N
        attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + bias.unsqueeze(0)
        if mask is not None:
            attn = attn + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.num_heads, N, N).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj(x)


class Transformer2DBlock(nn.Module):
    def __init__(self, dim, input_resolution, num_heads, window_size=(2, 6), shift_size=(1, 3)):
        super().__init__()
        self.input_resolution = input_resolution
        self.window_size = window_size
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = EarthAttention2D(dim, input_resolution, window_size, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.roll = shift_size[0] and shift_size[1]
        self.register_buffer("attn_mask", get_shift_window_mask(input_resolution, window_size, shift_size))

    def forward(self, x):
        Lat, Lon = self.input_resolution
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).view(B, Lat, Lon, C)
        shift_lat, shift_lon = self.shift_size
        if self.roll:
            if FIXED:
                shifted_x = torch.roll(x, shifts=(-shift_lat, -shift_lon), dims=(1, 2))
            else:
                shifted_x = torch.roll(x, shifts=(-shift_lat, -shift_lat), dims=(1, 2))
        else:
            shifted_x = x
        x_windows = window_partition(shifted_x, self.window_size)
        attn_windows = self.attn(x_windows, mask=self.attn_mask)
        shifted_x = window_reverse(attn_windows, self.window_size, Lat, Lon)
        if self.roll:
            x = torch.roll(shifted_x, shifts=(shift_lat, shift_lon), dims=(1, 2))
        else:
            x = shifted_x
        x = shortcut + x.reshape(B, Lat * Lon, C)
        return x + self.mlp(self.norm2(x))


class FengWuEncoderStage(nn.Module):
    def __init__(self, dim=16, input_resolution=(4, 12), num_heads=2):
        super().__init__()
        self.blocks = nn.ModuleList([
            Transformer2DBlock(dim, input_resolution, num_heads, shift_size=(0, 0)),
            Transformer2DBlock(dim, input_resolution, num_heads, shift_size=(1, 3)),
        ])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


if __name__ == "__main__":
    Lat, Lon, C = 4, 12, 16
    model = FengWuEncoderStage(C, (Lat, Lon)).eval()
    fields = torch.randn(2, Lat * Lon, C)
    with torch.no_grad():
        out = model(fields)
        FIXED_SAVED = FIXED
        globals()["FIXED"] = True
        ref = model(fields)
        globals()["FIXED"] = FIXED_SAVED
    print(f"fixed={FIXED} out shape={tuple(out.shape)} max|out - ref(shift_lon roll)|={(out - ref).abs().max():.4f}")
