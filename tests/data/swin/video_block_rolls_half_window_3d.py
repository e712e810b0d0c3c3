# Written another way (checks/swinroll.py, as Pangu's EarthSpecificBlock before lizhuoq/WeatherLearn dc896e6): a
# Video-Swin-style 3-D block over channel-first clips (B, C, T, H, W), windows of (2, 4, 4) and shift_size (1, 1, 1);
# its mask is cut for that shift, but the forward rolls the clip by half the window, (-1, -2, -2), so along H and W
# the windows bring together other tokens than the ones its mask keeps apart. The fix rolls by -shift_size.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def to_windows(x: torch.Tensor, size) -> torch.Tensor:
    """(B, C, T, H, W) -> (B * nW, N, C), windows in (t, h, w) order, tokens in (t, h, w) order."""
    b, c, t, h, w = x.shape
    wt, wh, ww = size
    x = x.view(b, c, t // wt, wt, h // wh, wh, w // ww, ww)
    return x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(-1, wt * wh * ww, c)


def from_windows(windows: torch.Tensor, size, b: int, t: int, h: int, w: int) -> torch.Tensor:
    wt, wh, ww = size
    x = windows.view(b, t // wt, h // wh, w // ww, wt, wh, ww, -1)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, t, h, w)


def shift_mask(t: int, h: int, w: int, size, shift) -> torch.Tensor:
    """(nW, N, N) additive: 0 within one region of the rolled clip, -inf across."""
    labels = torch.zeros(1, 1, t, h, w)
    count = 0
    for ts in (slice(0, -size[0]), slice(-size[0], -shift[0]), slice(-shift[0], None)):
        for hs in (slice(0, -size[1]), slice(-size[1], -shift[1]), slice(-shift[1], None)):
            for ws in (slice(0, -size[2]), slice(-size[2], -shift[2]), slice(-shift[2], None)):
                labels[:, :, ts, hs, ws] = count
                count += 1
    cells = to_windows(labels, size)[..., 0]
    return torch.zeros(cells.shape[0], cells.shape[1], cells.shape[1]).masked_fill(
        cells[:, :, None] != cells[:, None, :], float("-inf"))


class VideoBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window_size=(2, 4, 4), shift_size=(1, 1, 1)):
        super().__init__()
        self.heads, self.window_size, self.shift_size = heads, window_size, shift_size
        self.norm = nn.GroupNorm(1, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, clip: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = clip.shape
        normed = self.norm(clip)
        if FIXED:
            offsets = tuple(-s for s in self.shift_size)
        else:
            offsets = tuple(-(s // 2) for s in self.window_size)
        rolled = torch.roll(normed, shifts=offsets, dims=(2, 3, 4))
        windows = to_windows(rolled, self.window_size)
        mask = shift_mask(t, h, w, self.window_size, self.shift_size).repeat(b, 1, 1)
        q, k, v = self.qkv(windows).view(windows.shape[0], -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * (c // self.heads) ** -0.5 + mask[:, None]
        out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)
        out = self.proj(out.transpose(1, 2).reshape(windows.shape[0], -1, c))
        back = torch.roll(from_windows(out, self.window_size, b, t, h, w), shifts=tuple(-o for o in offsets),
                          dims=(2, 3, 4))
        return clip + back


block = VideoBlock(dim=16, heads=2).eval()
with torch.no_grad():
    clip = torch.randn(2, 16, 4, 8, 8)
    out = block(clip)
print(f"video block output {tuple(out.shape)}")
