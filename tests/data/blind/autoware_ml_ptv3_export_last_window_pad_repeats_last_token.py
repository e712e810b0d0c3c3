# Citation: tier4/autoware-ml PR #93, "fix(ptv3): pad last attention window by wrapping, not by
#   repeating" (merged 2026-08). Buggy code read at commit 04952dfd92d3ae6d21e1166e8c04b178da09f6bb.
# Upstream: autoware_ml/models/segmentation3d/encoders/ptv3.py,
#   SerializedAttention._get_padding_and_inverse / SerializedAttention.forward and
#   prepare_point_module_for_export (export = flash disabled, export_mode = True).
# Bug: PTv3 windowed attention over serialized points needs a full last window of patch_size tokens.
#   Training (flash varlen path) fills the trailing slots of the last window by borrowing the tokens
#   one window earlier, so every slot is a distinct real token. The export path instead built
#   `pad = clamp(arange(padded_n), max=n - 1)`: the trailing slots all repeat the last real token,
#   which then sits up to K-1 times in the unmasked softmax of every query of that window.
# Fix: in export mode, wrap the trailing slots: slot i >= n reads token (i - K + ceil(K/n)*n) % n,
#   i.e. the same borrow as training (n > K) or a round-robin cycle (n <= K). (Index formula as the
#   PR describes it: exact / borrow from the preceding window / round-robin cycle.)
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def offset_to_bincount(offset):
    return torch.diff(offset, prepend=torch.tensor([0], device=offset.device, dtype=torch.long))


def shape_as_tensor(x):
    return torch.tensor(x.shape, dtype=torch.long)


class FlashAttnStandIn:
    """Plain-torch flash_attn_varlen_qkvpacked_func: non-causal attention inside each cu_seqlens segment."""

    @staticmethod
    def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         deterministic=False):
        qkv = qkv.float()
        out = torch.empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])
        for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            q, k, v = qkv[s:e].unbind(dim=1)  # (L, H, D)
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            attn = torch.softmax((q * softmax_scale) @ k.transpose(-2, -1), dim=-1)
            out[s:e] = (attn @ v).transpose(0, 1)
        return out


def load_flash_attn_module():
    return FlashAttnStandIn


class Point:
    def __init__(self, feat, offset, grid_coord, serialized_order, serialized_inverse):
        self.feat = feat
        self.offset = offset
        self.grid_coord = grid_coord
        self.serialized_order = serialized_order
        self.serialized_inverse = serialized_inverse


class SerializedAttention(nn.Module):
    def __init__(self, channels, num_heads, patch_size, qkv_bias, qk_scale, attn_drop, proj_drop,
                 order_index, enable_rpe, enable_flash, upcast_attention, upcast_softmax):
        super().__init__()
        self.channels = channels
        self.num_heads = num_heads
        self.enable_flash = enable_flash
        self.patch_size_max = patch_size
        self.patch_size = patch_size if enable_flash else 0
        self.scale = qk_scale or (channels // num_heads) ** -0.5
        self.order_index = order_index
        self.upcast_attention = upcast_attention
        self.upcast_softmax = upcast_softmax
        self.enable_rpe = enable_rpe
        self.export_mode = False
        self.qkv = nn.Linear(channels, channels * 3, bias=qkv_bias)
        self.proj = nn.Linear(channels, channels)
        self.proj_drop = nn.Dropout(proj_drop)
        self.attn_drop_p = attn_drop
        self.attn_drop = nn.Dropout(attn_drop)
        self.softmax = nn.Softmax(dim=-1)
        self.rpe = None
        self.flash_attn = None

    @torch.no_grad()
    def _get_padding_and_inverse(self, point):
        bincount = offset_to_bincount(point.offset)
        padded_bincount = (
            torch.maximum(
                torch.div(bincount + self.patch_size - 1, self.patch_size, rounding_mode="trunc"),
                torch.ones_like(bincount),
            )
            * self.patch_size
        )
        mask = bincount > self.patch_size
        padded_bincount = (~mask).long() * bincount + mask.long() * padded_bincount

        if self.export_mode:
            if point.offset.numel() != 1:
                raise ValueError("PTv3 export mode supports only single-sample export batches.")
            n = shape_as_tensor(point.feat)[0].to(device=point.offset.device)
            padded_n = ((n + self.patch_size - 1) // self.patch_size) * self.patch_size
            unpad = torch.arange(n, device=point.offset.device)
            if FIXED:
                # Wrap the trailing slots: borrow from the preceding window (n > K) or cycle (n <= K).
                index = torch.arange(padded_n, device=point.offset.device)
                shift = ((self.patch_size + n - 1) // n) * n
                pad = torch.where(index < n, index, (index - self.patch_size + shift) % n)
            else:
                # Clamp pad indices to [0, n-1]: dummy slots repeat the last real token.
                pad = torch.clamp(torch.arange(padded_n, device=point.offset.device), max=n - 1)
            if not self.enable_flash:
                return pad, unpad, None
            cu_seqlens = torch.arange(0, padded_n + 1, step=self.patch_size, dtype=torch.int32,
                                      device=point.offset.device)
            return pad, unpad, cu_seqlens

        offset = nn.functional.pad(point.offset, (1, 0))
        padded_offset = nn.functional.pad(torch.cumsum(padded_bincount, dim=0), (1, 0))
        pad = torch.arange(padded_offset[-1], device=point.offset.device)
        unpad = torch.arange(offset[-1], device=point.offset.device)
        cu_seqlens = [] if self.enable_flash else None
        for batch_index in range(point.offset.numel()):
            unpad[offset[batch_index]: offset[batch_index + 1]] += (
                padded_offset[batch_index] - offset[batch_index]
            )
            if bincount[batch_index] != padded_bincount[batch_index]:
                pad[
                    padded_offset[batch_index + 1]
                    - self.patch_size
                    + (bincount[batch_index] % self.patch_size): padded_offset[batch_index + 1]
                ] = pad[
                    padded_offset[batch_index + 1]
                    - 2 * self.patch_size
                    + (bincount[batch_index] % self.patch_size): padded_offset[batch_index + 1]
                    - self.patch_size
                ]
            pad[padded_offset[batch_index]: padded_offset[batch_index + 1]] -= (
                padded_offset[batch_index] - offset[batch_index]
            )
            if cu_seqlens is not None:
                cu_seqlens.append(
                    torch.arange(padded_offset[batch_index], padded_offset[batch_index + 1],
                                 step=self.patch_size, dtype=torch.int32, device=point.offset.device)
                )
        if cu_seqlens is None:
            return pad, unpad, None
        return pad, unpad, nn.functional.pad(torch.cat(cu_seqlens), (0, 1), value=padded_offset[-1])

    @torch.no_grad()
    def disable_flash(self):
        self.enable_flash = False
        self.patch_size = 0
        self.flash_attn = None

    def forward(self, point):
        head_count = self.num_heads
        if not self.enable_flash:
            min_points = int(offset_to_bincount(point.offset).min().item())
            if self.export_mode and min_points < self.patch_size_max:
                raise ValueError("PTv3 export mode requires at least patch_size points per sample")
            self.patch_size = self.patch_size_max if self.export_mode else min_points
        patch_size = self.patch_size
        channel_count = self.channels
        pad, unpad, cu_seqlens = self._get_padding_and_inverse(point)
        order = point.serialized_order[self.order_index][pad]
        inverse = unpad[point.serialized_inverse[self.order_index]]
        qkv = self.qkv(point.feat)[order]

        if not self.enable_flash:
            qkv = qkv.reshape(-1, patch_size, 3, head_count, channel_count // head_count)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(dim=0)
            if self.upcast_attention:
                q = q.float()
                k = k.float()
            attention = (q * self.scale) @ k.transpose(-2, -1)
            if self.upcast_softmax:
                attention = attention.float()
            attention = self.softmax(attention)
            attention = self.attn_drop(attention).to(qkv.dtype)
            feat = (attention @ v).transpose(1, 2).reshape(-1, channel_count)
        else:
            if self.flash_attn is None:
                self.flash_attn = load_flash_attn_module()
            feat = self.flash_attn.flash_attn_varlen_qkvpacked_func(
                qkv.reshape(-1, 3, head_count, channel_count // head_count),
                cu_seqlens,
                max_seqlen=patch_size,
                dropout_p=self.attn_drop_p if self.training else 0.0,
                softmax_scale=self.scale,
                deterministic=True,
            ).reshape(-1, channel_count)
            feat = feat.to(qkv.dtype)
        feat = feat[inverse]
        point.feat = self.proj_drop(self.proj(feat))
        return point


def prepare_point_module_for_export(module):
    for child in module.modules():
        if isinstance(child, SerializedAttention):
            child.disable_flash()
            child.export_mode = True


def z_order_code(grid_coord, depth=4):
    code = torch.zeros(grid_coord.shape[0], dtype=torch.long)
    for bit in range(depth):
        for axis in range(3):
            code |= ((grid_coord[:, axis] >> bit) & 1) << (3 * bit + axis)
    return code


def make_point(n, channels):
    grid_coord = torch.randint(0, 16, (n, 3))
    order = torch.argsort(z_order_code(grid_coord))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n)
    feat = torch.randn(n, channels)
    return Point(feat, torch.tensor([n]), grid_coord, [order], [inverse])


channels, heads, patch_size = 16, 2, 8
n_points = 19  # one LiDAR frame after voxelization: not a multiple of patch_size
attn = SerializedAttention(channels, heads, patch_size, qkv_bias=True, qk_scale=None, attn_drop=0.0,
                           proj_drop=0.0, order_index=0, enable_rpe=False, enable_flash=True,
                           upcast_attention=False, upcast_softmax=False).eval()
point = make_point(n_points, channels)
feat_in = point.feat.clone()

with torch.no_grad():
    out_torch = attn(Point(feat_in.clone(), point.offset, point.grid_coord,
                           point.serialized_order, point.serialized_inverse)).feat
    prepare_point_module_for_export(attn)
    out_export = attn(Point(feat_in.clone(), point.offset, point.grid_coord,
                            point.serialized_order, point.serialized_inverse)).feat

print("points:", n_points, "patch_size:", patch_size)
print("pytorch (flash) out[:3, :4]:\n", out_torch[:3, :4])
print("export out[:3, :4]:\n", out_export[:3, :4])
print("max |export - pytorch|: %.6f" % (out_export - out_torch).abs().max().item())
print("export feature norm: %.4f" % out_export.norm().item())
