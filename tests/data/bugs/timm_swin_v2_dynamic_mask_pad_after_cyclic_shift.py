# Citation: huggingface/pytorch-image-models#2438 ("swin v2 adding padding to shifted window attention
#   breaks the algorithm"; open issue, maintainer: "might be a concern"). Code read at timm HEAD
#   (snapshot aa4b5850; file last changed in 41754f29), timm/models/swin_transformer_v2.py:
#   SwinTransformerV2Block._attn, SwinTransformerV2Block.get_attn_mask (dynamic_mask=True),
#   window_partition / window_reverse, WindowAttention (cosine attention + cpb_mlp bias).
# Bug: for a feature map whose size is not a multiple of the window, _attn rolls the map by
#   -shift_size FIRST and pads it to a multiple of the window AFTERWARDS, while get_attn_mask labels
#   the shifted-window regions on the padded map as if the wrapped rows/cols were its last
#   shift_size rows/cols. The wrapped tokens really sit before the padding, so they share a region
#   (and attend freely) with tokens from the far side of the image, and are cut off from their
#   true neighbours.
# Fix (the expectation; what microsoft/Swin-Transformer's detection backbone and
#   transformers' SwinLayer do): pad first, then apply the cyclic shift, so the -100 region mask
#   built on the padded map lines up with the rolled tokens; crop back to H, W after un-rolling.
import math
import sys
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def to_2tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x, x)


def ndgrid(*tensors):
    return torch.meshgrid(*tensors, indexing="ij")


def window_partition(x: torch.Tensor, window_size: Tuple[int, int]) -> torch.Tensor:
    B, H, W, C = x.shape
    x = x.view(B, H // window_size[0], window_size[0], W // window_size[1], window_size[1], C)
    windows = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size[0], window_size[1], C)
    return windows


def window_reverse(windows: torch.Tensor, window_size: Tuple[int, int], img_size: Tuple[int, int]) -> torch.Tensor:
    H, W = img_size
    C = windows.shape[-1]
    x = windows.view(-1, H // window_size[0], W // window_size[1], window_size[0], window_size[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, H, W, C)
    return x


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class WindowAttention(nn.Module):
    def __init__(self, dim, window_size, num_heads, qkv_bias=True, pretrained_window_size=(0, 0)):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.pretrained_window_size = to_2tuple(pretrained_window_size)
        self.num_heads = num_heads
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((num_heads, 1, 1))))
        self.cpb_mlp = nn.Sequential(
            nn.Linear(2, 512, bias=True), nn.ReLU(inplace=True), nn.Linear(512, num_heads, bias=False)
        )
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        if qkv_bias:
            self.q_bias = nn.Parameter(torch.zeros(dim))
            self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
            self.v_bias = nn.Parameter(torch.zeros(dim))
        else:
            self.q_bias = None
            self.k_bias = None
            self.v_bias = None
        self.proj = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)
        table, index = self._make_pair_wise_relative_positions()
        self.register_buffer("relative_coords_table", table, persistent=False)
        self.register_buffer("relative_position_index", index, persistent=False)

    def _make_pair_wise_relative_positions(self):
        relative_coords_h = torch.arange(-(self.window_size[0] - 1), self.window_size[0], dtype=torch.float32)
        relative_coords_w = torch.arange(-(self.window_size[1] - 1), self.window_size[1], dtype=torch.float32)
        relative_coords_table = torch.stack(ndgrid(relative_coords_h, relative_coords_w))
        relative_coords_table = relative_coords_table.permute(1, 2, 0).contiguous().unsqueeze(0)
        if self.pretrained_window_size[0] > 0:
            relative_coords_table[:, :, :, 0] /= (self.pretrained_window_size[0] - 1)
            relative_coords_table[:, :, :, 1] /= (self.pretrained_window_size[1] - 1)
        else:
            relative_coords_table[:, :, :, 0] /= (self.window_size[0] - 1)
            relative_coords_table[:, :, :, 1] /= (self.window_size[1] - 1)
        relative_coords_table *= 8
        relative_coords_table = torch.sign(relative_coords_table) * torch.log2(
            torch.abs(relative_coords_table) + 1.0) / math.log2(8)

        coords_h = torch.arange(self.window_size[0])
        coords_w = torch.arange(self.window_size[1])
        coords = torch.stack(ndgrid(coords_h, coords_w))
        coords_flatten = torch.flatten(coords, 1)
        relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
        relative_coords = relative_coords.permute(1, 2, 0).contiguous()
        relative_coords[:, :, 0] += self.window_size[0] - 1
        relative_coords[:, :, 1] += self.window_size[1] - 1
        relative_coords[:, :, 0] *= 2 * self.window_size[1] - 1
        relative_position_index = relative_coords.sum(-1)
        return relative_coords_table, relative_position_index

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B_, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)

        # cosine attention
        attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1))
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1. / 0.01)).exp()
        attn = attn * logit_scale

        relative_position_bias_table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        relative_position_bias = relative_position_bias_table[self.relative_position_index.view(-1)].view(
            self.window_size[0] * self.window_size[1], self.window_size[0] * self.window_size[1], -1)
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()
        relative_position_bias = 16 * torch.sigmoid(relative_position_bias)
        attn = attn + relative_position_bias.unsqueeze(0)

        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
            attn = self.softmax(attn)
        else:
            attn = self.softmax(attn)

        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        x = self.proj(x)
        return x


class SwinTransformerV2Block(nn.Module):
    def __init__(self, dim, input_resolution, num_heads, window_size=7, shift_size=0,
                 always_partition=False, dynamic_mask=False, mlp_ratio=4.):
        super().__init__()
        self.dim = dim
        self.input_resolution = to_2tuple(input_resolution)
        self.num_heads = num_heads
        self.target_shift_size = to_2tuple(shift_size)
        self.always_partition = always_partition
        self.dynamic_mask = dynamic_mask
        self.window_size, self.shift_size = self._calc_window_shift(window_size, shift_size)
        self.window_area = self.window_size[0] * self.window_size[1]
        self.attn = WindowAttention(dim, window_size=to_2tuple(self.window_size), num_heads=num_heads)
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.norm2 = nn.LayerNorm(dim)
        self.register_buffer(
            "attn_mask", None if self.dynamic_mask else self.get_attn_mask(), persistent=False)

    def get_attn_mask(self, x: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if any(self.shift_size):
            if x is None:
                img_mask = torch.zeros((1, *self.input_resolution, 1))
            else:
                img_mask = torch.zeros((1, x.shape[1], x.shape[2], 1), device=x.device, dtype=x.dtype)
            cnt = 0
            for h in (
                    (0, -self.window_size[0]),
                    (-self.window_size[0], -self.shift_size[0]),
                    (-self.shift_size[0], None),
            ):
                for w in (
                        (0, -self.window_size[1]),
                        (-self.window_size[1], -self.shift_size[1]),
                        (-self.shift_size[1], None),
                ):
                    img_mask[:, h[0]:h[1], w[0]:w[1], :] = cnt
                    cnt += 1
            mask_windows = window_partition(img_mask, self.window_size)
            mask_windows = mask_windows.view(-1, self.window_area)
            attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
            attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))
        else:
            attn_mask = None
        return attn_mask

    def _calc_window_shift(self, target_window_size, target_shift_size=None):
        target_window_size = to_2tuple(target_window_size)
        target_shift_size = to_2tuple(target_shift_size)
        if self.always_partition:
            return target_window_size, target_shift_size
        window_size = [r if r <= w else w for r, w in zip(self.input_resolution, target_window_size)]
        shift_size = [0 if r <= w else s for r, w, s in zip(self.input_resolution, window_size, target_shift_size)]
        return tuple(window_size), tuple(shift_size)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        has_shift = any(self.shift_size)
        pad_h = (self.window_size[0] - H % self.window_size[0]) % self.window_size[0]
        pad_w = (self.window_size[1] - W % self.window_size[1]) % self.window_size[1]

        if FIXED:
            # pad to a multiple of the window, then cyclic shift
            shifted_x = torch.nn.functional.pad(x, (0, 0, 0, pad_w, 0, pad_h))
            if has_shift:
                shifted_x = torch.roll(shifted_x, shifts=(-self.shift_size[0], -self.shift_size[1]), dims=(1, 2))
        else:
            # cyclic shift
            if has_shift:
                shifted_x = torch.roll(x, shifts=(-self.shift_size[0], -self.shift_size[1]), dims=(1, 2))
            else:
                shifted_x = x
            shifted_x = torch.nn.functional.pad(shifted_x, (0, 0, 0, pad_w, 0, pad_h))
        _, Hp, Wp, _ = shifted_x.shape

        x_windows = window_partition(shifted_x, self.window_size)
        x_windows = x_windows.view(-1, self.window_area, C)

        if getattr(self, "dynamic_mask", False):
            attn_mask = self.get_attn_mask(shifted_x)
        else:
            attn_mask = self.attn_mask
        attn_windows = self.attn(x_windows, mask=attn_mask)

        attn_windows = attn_windows.view(-1, self.window_size[0], self.window_size[1], C)
        shifted_x = window_reverse(attn_windows, self.window_size, (Hp, Wp))

        if FIXED:
            if has_shift:
                shifted_x = torch.roll(shifted_x, shifts=self.shift_size, dims=(1, 2))
            x = shifted_x[:, :H, :W, :].contiguous()
        else:
            shifted_x = shifted_x[:, :H, :W, :].contiguous()
            if has_shift:
                x = torch.roll(shifted_x, shifts=self.shift_size, dims=(1, 2))
            else:
                x = shifted_x
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        x = x + self.norm1(self._attn(x))
        x = x.reshape(B, -1, C)
        x = x + self.norm2(self.mlp(x))
        x = x.reshape(B, H, W, C)
        return x


class TinySwinV2(nn.Module):
    """Patch embed -> one stage of (W-MSA, SW-MSA) SwinV2 blocks -> avg pool head."""

    def __init__(self, img_size=36, patch_size=4, in_chans=3, embed_dim=32, num_heads=2,
                 window_size=4, depth=2, num_classes=5):
        super().__init__()
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.embed_norm = nn.LayerNorm(embed_dim)
        grid = img_size // patch_size
        shift_size = window_size // 2
        self.blocks = nn.Sequential(*[
            SwinTransformerV2Block(
                embed_dim, input_resolution=(grid, grid), num_heads=num_heads,
                window_size=window_size, shift_size=0 if (i % 2 == 0) else shift_size,
                dynamic_mask=True)
            for i in range(depth)
        ])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).permute(0, 2, 3, 1)  # B H W C
        x = self.embed_norm(x)
        x = self.blocks(x)
        x = self.norm(x)
        return self.head(x.mean(dim=(1, 2)))


def main():
    torch.manual_seed(0)
    model = TinySwinV2()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.2)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    model.eval()

    # 36x36 images -> a 9x9 token map, not a multiple of the 4x4 window
    images = torch.randn(2, 3, 36, 36)
    labels = torch.tensor([1, 3])
    with torch.no_grad():
        feats = model.embed_norm(model.patch_embed(images).permute(0, 2, 3, 1))
        block_out = model.blocks[1](model.blocks[0](feats))
        logits = model(images)
    loss = F.cross_entropy(logits, labels)
    print("token map:", tuple(feats.shape[1:3]), "window:", model.blocks[1].window_size,
          "shift:", model.blocks[1].shift_size)
    print("block out [0, 0, 0, :4]:", [round(v, 4) for v in block_out[0, 0, 0, :4].tolist()])
    print("block out [1, 8, 8, :4]:", [round(v, 4) for v in block_out[1, 8, 8, :4].tolist()])
    print("logits:", [[round(v, 4) for v in row] for row in logits.tolist()])
    print("loss:", round(loss.item(), 5))


if __name__ == "__main__":
    main()
