# ChristophReich1996/MaxViT#2 (fixed in commits 08be6f4 + c033d09): grid_partition/grid_reverse used the
# window (block) layout view(B, C, H//g, g, W//g, g), so "grid attention" attended within local blocks
# instead of the dilated global grid (tokens H//g apart); the attention pattern is silently wrong.
import sys
from typing import Tuple
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def grid_partition(input: torch.Tensor, grid_size: Tuple[int, int] = (7, 7)) -> torch.Tensor:
    B, C, H, W = input.shape
    if FIXED:
        grid = input.view(B, C, grid_size[0], H // grid_size[0], grid_size[1], W // grid_size[1])
        grid = grid.permute(0, 3, 5, 2, 4, 1).contiguous().view(-1, grid_size[0], grid_size[1], C)
        return grid
    windows = input.view(B, C, H // grid_size[0], grid_size[0], W // grid_size[1], grid_size[1])
    windows = windows.permute(0, 3, 5, 2, 4, 1).contiguous().view(-1, grid_size[0], grid_size[1], C)
    return windows


def grid_reverse(grid: torch.Tensor, original_size: Tuple[int, int], grid_size: Tuple[int, int] = (7, 7)) -> torch.Tensor:
    (H, W), C = original_size, grid.shape[-1]
    B = int(grid.shape[0] / (H * W / grid_size[0] / grid_size[1]))
    if FIXED:
        output = grid.view(B, H // grid_size[0], W // grid_size[1], grid_size[0], grid_size[1], C)
    else:
        output = grid.view(B, grid_size[0], grid_size[1], H // grid_size[0], W // grid_size[1], C)
    output = output.permute(0, 5, 3, 1, 4, 2).contiguous().view(B, C, H, W)
    return output


def get_relative_position_index(win_h: int, win_w: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid([torch.arange(win_h), torch.arange(win_w)], indexing="ij"))
    coords_flatten = torch.flatten(coords, 1)
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0).contiguous()
    relative_coords[:, :, 0] += win_h - 1
    relative_coords[:, :, 1] += win_w - 1
    relative_coords[:, :, 0] *= 2 * win_w - 1
    return relative_coords.sum(-1)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class RelativeSelfAttention(nn.Module):
    def __init__(self, in_channels: int, num_heads: int = 32, grid_window_size: Tuple[int, int] = (7, 7)) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.num_heads = num_heads
        self.grid_window_size = grid_window_size
        self.scale = num_heads ** -0.5
        self.attn_area = grid_window_size[0] * grid_window_size[1]
        self.qkv_mapping = nn.Linear(in_features=in_channels, out_features=3 * in_channels, bias=True)
        self.proj = nn.Linear(in_features=in_channels, out_features=in_channels, bias=True)
        self.softmax = nn.Softmax(dim=-1)
        self.relative_position_bias_table = nn.Parameter(
            torch.randn((2 * grid_window_size[0] - 1) * (2 * grid_window_size[1] - 1), num_heads) * 0.02)
        self.register_buffer("relative_position_index", get_relative_position_index(grid_window_size[0],
                                                                                    grid_window_size[1]))

    def _get_relative_positional_bias(self) -> torch.Tensor:
        relative_position_bias = self.relative_position_bias_table[
            self.relative_position_index.view(-1)].view(self.attn_area, self.attn_area, -1)
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()
        return relative_position_bias.unsqueeze(0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        B_, N, C = input.shape
        qkv = self.qkv_mapping(input).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = self.softmax(q @ k.transpose(-2, -1) + self._get_relative_positional_bias())
        output = (attn @ v).transpose(1, 2).reshape(B_, N, -1)
        return self.proj(output)


class MaxViTTransformerBlock(nn.Module):
    def __init__(self, in_channels, partition_function, reverse_function, num_heads=2, grid_window_size=(7, 7),
                 mlp_ratio=2.):
        super().__init__()
        self.partition_function = partition_function
        self.reverse_function = reverse_function
        self.grid_window_size = grid_window_size
        self.norm_1 = nn.LayerNorm(in_channels)
        self.attention = RelativeSelfAttention(in_channels, num_heads, grid_window_size)
        self.norm_2 = nn.LayerNorm(in_channels)
        self.mlp = Mlp(in_channels, int(mlp_ratio * in_channels))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        B, C, H, W = input.shape
        input_partitioned = self.partition_function(input, self.grid_window_size)
        input_partitioned = input_partitioned.view(-1, self.grid_window_size[0] * self.grid_window_size[1], C)
        output = input_partitioned + self.attention(self.norm_1(input_partitioned))
        output = output * self.mlp(self.norm_2(output))
        output = self.reverse_function(output, (H, W), self.grid_window_size)
        return output


# grid attention block: 8x8 map, grid 2x2 -> each token should attend to the 4 tokens spaced 4 apart
B, C, H, W, G = 2, 32, 8, 8, 2
blk = MaxViTTransformerBlock(C, grid_partition, grid_reverse, num_heads=2, grid_window_size=(G, G)).eval()
x = torch.randn(B, C, H, W)
stride = H // G
violations = 0
with torch.no_grad():
    base = blk(x)
    for ph in range(H):
        for pw in range(W):
            xp = x.clone()
            xp[:, :, ph, pw] += torch.randn(B, C)  # random (a constant would be removed by LayerNorm)
            changed = (blk(xp) - base).abs().amax(dim=(0, 1)) > 1e-6  # H, W
            hh, ww = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
            same_grid = (hh % stride == ph % stride) & (ww % stride == pw % stride)
            violations += int((changed != same_grid).sum())
print("positions whose dependence breaks the dilated grid pattern: %d" % violations)
