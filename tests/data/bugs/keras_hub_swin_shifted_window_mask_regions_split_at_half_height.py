# Citation: keras-team/keras-hub PR #2298 ("Add Swin Transformer Backbone", squash-merged as
#   8b982a0df), fixed on the PR branch by commit d7e3f89e1 ("Fix attention mask slicing for
#   shifted windows").
# Upstream: keras_hub/src/models/swin_transformer/swin_transformer_layers.py,
#   SwinTransformerBlock.call (img_mask h_slices / w_slices -> window_partition ->
#   attn_mask of 0 / -100), used by WindowAttention.call. The Keras port of Microsoft's
#   PyTorch Swin, ported back to torch here.
# Bug: the shifted-window region labels were cut at H // 2 and W // 2 instead of at
#   H - window_size and W - window_size. Unless H == 2 * window_size, the -100 mask splits
#   tokens that are contiguous in the rolled image and leaves the wrap-around boundary
#   mislocated, so SW-MSA masks the wrong pairs.
# Fix: slices (0, H - window_size), (H - window_size, H - shift_size), (H - shift_size, H)
#   (and the same for W), as in the original Swin.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def get_relative_position_index(win_h, win_w):
    xx, yy = torch.meshgrid(torch.arange(win_h), torch.arange(win_w), indexing="xy")
    coords = torch.stack([yy, xx], dim=0)
    coords_flatten = coords.reshape(2, -1)
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0)
    xx = (relative_coords[:, :, 0] + win_h - 1) * (2 * win_w - 1)
    yy = relative_coords[:, :, 1] + win_w - 1
    relative_coords = torch.stack([xx, yy], dim=-1)
    return relative_coords.sum(-1)


def window_partition(x, window_size):
    B, H, W, C = x.shape
    pad_h = (window_size - H % window_size) % window_size
    pad_w = (window_size - W % window_size) % window_size
    if pad_h > 0 or pad_w > 0:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
        H = H + pad_h
        W = W + pad_w
    num_windows_h = H // window_size
    num_windows_w = W // window_size
    x = x.reshape(B, num_windows_h, window_size, num_windows_w, window_size, C)
    x = x.permute(0, 1, 3, 2, 4, 5)
    windows = x.reshape(-1, window_size, window_size, C)
    return windows, (H, W)


def window_reverse(windows, window_size, height, width, channels):
    num_windows_h = height // window_size
    num_windows_w = width // window_size
    batch_size = windows.shape[0] // (num_windows_h * num_windows_w)
    x = windows.reshape(batch_size, num_windows_h, num_windows_w, window_size, window_size, channels)
    x = x.permute(0, 1, 3, 2, 4, 5)
    return x.reshape(batch_size, height, width, channels)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class WindowAttention(nn.Module):
    def __init__(self, dim, num_heads, window_size=7, qkv_bias=True):
        super().__init__()
        self.dim = dim
        self.win_h, self.win_w = (window_size, window_size)
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.relative_position_index = get_relative_position_index(self.win_h, self.win_w)
        self.qkv = nn.Linear(dim, self.head_dim * num_heads * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(
            torch.randn((2 * self.win_h - 1) * (2 * self.win_w - 1), num_heads) * 0.02
        )

    def _get_rel_pos_bias(self):
        relative_position_bias = self.relative_position_bias_table[self.relative_position_index]
        return relative_position_bias.permute(2, 0, 1)

    def forward(self, x, mask=None):
        """x: (num_windows*B, N, C); mask: (0/-100) of shape (num_windows, N, N) or None."""
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn + self._get_rel_pos_bias()
        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.reshape(B_ // num_win, num_win, self.num_heads, N, N)
            attn = attn + mask.unsqueeze(1)[None, ...]
            attn = attn.reshape(-1, self.num_heads, N, N)
            attn = F.softmax(attn, -1)
        else:
            attn = F.softmax(attn, -1)
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj(x)


class SwinTransformerBlock(nn.Module):
    def __init__(self, dim, input_resolution, num_heads, window_size=7, shift_size=0, mlp_ratio=4.0):
        super().__init__()
        self.input_resolution = input_resolution
        self.window_size = window_size
        self.shift_size = shift_size
        if min(self.input_resolution) <= self.window_size:
            self.shift_size = 0
            self.window_size = min(self.input_resolution)
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = WindowAttention(dim=dim, num_heads=num_heads, window_size=window_size)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        H, W = self.input_resolution
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).reshape(B, H, W, C)

        attn_mask = None
        if self.shift_size > 0:
            shifted_x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
            img_mask = torch.zeros((1, H, W, 1), dtype=torch.int32)
            cnt = 0
            if FIXED:
                h_slices = [
                    (0, H - self.window_size),
                    (H - self.window_size, H - self.shift_size),
                    (H - self.shift_size, H),
                ]
                w_slices = [
                    (0, W - self.window_size),
                    (W - self.window_size, W - self.shift_size),
                    (W - self.shift_size, W),
                ]
            else:
                h_slices = [
                    (0, int(H // 2)),
                    (int(H // 2), int(H - self.shift_size)),
                    (int(H - self.shift_size), int(H)),
                ]
                w_slices = [
                    (0, int(W // 2)),
                    (int(W // 2), int(W - self.shift_size)),
                    (int(W - self.shift_size), int(W)),
                ]
            for h in h_slices:
                for w in w_slices:
                    h_start, h_end = h
                    w_start, w_end = w
                    img_mask[:, h_start:h_end, w_start:w_end, :] = cnt
                    cnt += 1
            mask_windows = window_partition(img_mask, self.window_size)[0]
            mask_windows = mask_windows.reshape(-1, self.window_size * self.window_size)
            attn_mask = (mask_windows.unsqueeze(1) != mask_windows.unsqueeze(2)).float() * -100.0
        else:
            shifted_x = x

        x_windows, (H_pad, W_pad) = window_partition(shifted_x, self.window_size)
        x_windows = x_windows.reshape(-1, self.window_size * self.window_size, C)
        attn_windows = self.attn(x_windows, mask=attn_mask)
        attn_windows = attn_windows.reshape(-1, self.window_size, self.window_size, C)
        shifted_x = window_reverse(attn_windows, self.window_size, H_pad, W_pad, C)

        if self.shift_size > 0:
            x = torch.roll(shifted_x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        else:
            x = shifted_x
        if H_pad > H or W_pad > W:
            x = x[:, :H, :W, :]
        x = x.reshape(B, H * W, C)
        x = shortcut + x
        x = x + self.mlp(self.norm2(x))
        return x


class PatchMerging(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim, eps=1e-5)

    def forward(self, x, H, W):
        B, L, C = x.shape
        x = x.reshape(B, H, W, C)
        x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x0 = x[:, 0::2, 0::2, :]
        x1 = x[:, 1::2, 0::2, :]
        x2 = x[:, 0::2, 1::2, :]
        x3 = x[:, 1::2, 1::2, :]
        x = torch.cat([x0, x1, x2, x3], dim=-1)
        x = self.reduction(self.norm(x))
        return x.reshape(B, -1, 2 * C)


class PatchEmbedding(nn.Module):
    def __init__(self, patch_size=4, embed_dim=96, in_chans=3):
        super().__init__()
        self.embed_dim = embed_dim
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-3)

    def forward(self, x):  # x: (B, H, W, C) channels_last
        x = self.proj(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        x = x.reshape(x.shape[0], -1, self.embed_dim)
        return self.norm(x)


class SwinTransformerStage(nn.Module):
    def __init__(self, dim, depth, num_heads, window_size=7, mlp_ratio=4.0, downsample=None, input_resolution=None):
        super().__init__()
        self.input_resolution = input_resolution
        self.blocks = nn.ModuleList([
            SwinTransformerBlock(
                dim=dim,
                input_resolution=input_resolution,
                num_heads=num_heads,
                window_size=window_size,
                shift_size=0 if (i % 2 == 0) else window_size // 2,
                mlp_ratio=mlp_ratio,
            )
            for i in range(depth)
        ])
        self.downsample = downsample(dim=dim) if downsample is not None else None

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if self.downsample is not None:
            H, W = self.input_resolution
            x = self.downsample(x, H=H, W=W)
        return x


class SwinTransformerBackbone(nn.Module):
    def __init__(self, image_shape=(48, 48, 3), patch_size=4, embed_dim=16, depths=(2, 2),
                 num_heads=(2, 4), window_size=4, mlp_ratio=4.0):
        super().__init__()
        self.patch_embedding = PatchEmbedding(patch_size=patch_size, embed_dim=embed_dim, in_chans=image_shape[2])
        h, w = image_shape[0] // patch_size, image_shape[1] // patch_size
        stages = []
        for i in range(len(depths)):
            stages.append(SwinTransformerStage(
                dim=int(embed_dim * 2 ** i),
                depth=depths[i],
                num_heads=num_heads[i],
                window_size=window_size,
                mlp_ratio=mlp_ratio,
                downsample=PatchMerging if (i < len(depths) - 1) else None,
                input_resolution=(h, w),
            ))
            h //= 2
            w //= 2
        self.stages = nn.ModuleList(stages)
        self.output_norm = nn.LayerNorm(int(embed_dim * 2 ** (len(depths) - 1)), eps=1e-5)

    def forward(self, images):
        x = self.patch_embedding(images)
        for stage in self.stages:
            x = stage(x)
        return self.output_norm(x)


def main():
    backbone = SwinTransformerBackbone().eval()
    head = nn.Linear(32, 4)
    images = torch.rand(2, 48, 48, 3)  # 48 / 4 = 12x12 tokens, window 4, shift 2
    labels = torch.tensor([1, 3])
    with torch.no_grad():
        features = backbone(images)
        logits = head(features.mean(dim=1))
    loss = F.cross_entropy(logits, labels)
    print("fixed" if FIXED else "buggy")
    print("features", tuple(features.shape), "mean |x|: %.6f" % features.abs().mean().item())
    print("logits:", [[round(v, 4) for v in row] for row in logits.tolist()])
    print("loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
