"""Correct programs a reading of "items" could misjudge, in one run:

- a multi-view encoder handed a list of views, all one size, whose global attention attends every view's patches
  jointly on purpose (as VGGT's and MV-DUSt3R's global blocks do);
- a video tower given `grid_thw` whose spatial attention keeps each frame apart and whose temporal attention
  (a module named so) attends across the video's frames on purpose, never across the two videos."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x, mask=None):
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, d // self.heads).permute(1, 2, 0, 3)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0].transpose(0, 1).reshape(n, d)


class MultiView(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, 4)
        self.global_attn = Attention()

    def forward(self, views):
        x = torch.cat([self.patch(v).flatten(1).t() for v in views])  # every view's patches, one sequence
        return self.global_attn(x)


class VideoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.spatial_attn = Attention()
        self.temporal_attn = Attention()

    def forward(self, x, grid_thw):
        x = self.embed(x)
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        frame = torch.repeat_interleave(torch.arange(len(frames)), frames)
        video = torch.repeat_interleave(torch.arange(len(grid_thw)), grid_thw.prod(-1))
        x = x + self.spatial_attn(x, frame[:, None] == frame[None, :])
        return x + self.temporal_attn(x, video[:, None] == video[None, :])


torch.manual_seed(0)
with torch.no_grad():
    print(MultiView()([torch.randn(3, 8, 12) for _ in range(3)]).shape)
    grid = torch.tensor([[2, 2, 2], [3, 1, 2]])
    print(VideoTower()(torch.randn(int(grid.prod(-1).sum()), 8), grid).shape)
