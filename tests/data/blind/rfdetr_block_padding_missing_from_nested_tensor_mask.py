# roboflow/rf-detr#992: non-square batches were padded to the backbone block size by a per-image PadIfNeeded
# transform, so nested_tensor_from_tensor_list marked those zero pixels as real image; the decoder's deformable
# cross-attention (input_padding_mask) then attended to them. Fix: pad to the block size in the collator instead.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
BLOCK = 32  # patch_size * num_windows


class NestedTensor:
    def __init__(self, tensors, mask):
        self.tensors, self.mask = tensors, mask


def pad_if_needed(img, divisor):
    """Per-image transform (before the fix): zero-pad bottom/right to a multiple of the block size."""
    h, w = img.shape[-2:]
    return F.pad(img, (0, (-w) % divisor, 0, (-h) % divisor))


def nested_tensor_from_tensor_list(tensor_list, size_divisor=1):
    max_size = [max(s) for s in zip(*[img.shape for img in tensor_list])]
    max_size[1] = -(-max_size[1] // size_divisor) * size_divisor
    max_size[2] = -(-max_size[2] // size_divisor) * size_divisor
    b, (c, h, w) = len(tensor_list), max_size
    tensor = torch.zeros((b, c, h, w))
    mask = torch.ones((b, h, w), dtype=torch.bool)
    for img, pad_img, m in zip(tensor_list, tensor, mask):
        pad_img[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
        m[: img.shape[1], : img.shape[2]] = False
    return NestedTensor(tensor, mask)


def collate_fn(batch):
    if FIXED:
        return nested_tensor_from_tensor_list(batch, size_divisor=BLOCK)
    return nested_tensor_from_tensor_list(batch)


def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights):
    N_, S_, M_, D_ = value.shape
    _, Lq_, M_, L_, P_, _ = sampling_locations.shape
    value_list = value.split([H_ * W_ for H_, W_ in value_spatial_shapes], dim=1)
    sampling_grids = 2 * sampling_locations - 1
    sampling_value_list = []
    for lid_, (H_, W_) in enumerate(value_spatial_shapes):
        value_l_ = value_list[lid_].flatten(2).transpose(1, 2).reshape(N_ * M_, D_, H_, W_)
        sampling_grid_l_ = sampling_grids[:, :, :, lid_].transpose(1, 2).flatten(0, 1)
        sampling_value_l_ = F.grid_sample(value_l_, sampling_grid_l_, mode="bilinear", padding_mode="zeros",
                                          align_corners=False)
        sampling_value_list.append(sampling_value_l_)
    attention_weights = attention_weights.transpose(1, 2).reshape(N_ * M_, 1, Lq_, L_ * P_)
    output = (torch.stack(sampling_value_list, dim=-2).flatten(-2) * attention_weights).sum(-1)
    return output.view(N_, M_ * D_, Lq_).transpose(1, 2).contiguous()


class MSDeformAttn(nn.Module):
    def __init__(self, d_model=32, n_levels=1, n_heads=4, n_points=4):
        super().__init__()
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)

    def forward(self, query, reference_points, input_flatten, input_spatial_shapes, input_padding_mask=None):
        N, Len_q, _ = query.shape
        N, Len_in, _ = input_flatten.shape
        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], float(0))
        value = value.view(N, Len_in, self.n_heads, self.d_model // self.n_heads)
        sampling_offsets = self.sampling_offsets(query).view(N, Len_q, self.n_heads, self.n_levels, self.n_points, 2)
        attention_weights = self.attention_weights(query).view(N, Len_q, self.n_heads, self.n_levels * self.n_points)
        attention_weights = F.softmax(attention_weights, -1).view(N, Len_q, self.n_heads, self.n_levels,
                                                                   self.n_points)
        offset_normalizer = torch.stack([input_spatial_shapes[..., 1], input_spatial_shapes[..., 0]], -1)
        sampling_locations = reference_points[:, :, None, :, None, :] \
            + sampling_offsets / offset_normalizer[None, None, None, :, None, :]
        output = ms_deform_attn_core_pytorch(value, input_spatial_shapes, sampling_locations, attention_weights)
        return self.output_proj(output)


class LWDETRLite(nn.Module):
    def __init__(self, d_model=32, num_queries=5):
        super().__init__()
        self.backbone = nn.Conv2d(3, d_model, kernel_size=16, stride=16)  # patch embedding
        self.query_feat = nn.Embedding(num_queries, d_model)
        self.refpoint_embed = nn.Embedding(num_queries, 2)
        self.self_attn = nn.MultiheadAttention(d_model, 4, batch_first=True)
        self.cross_attn = MSDeformAttn(d_model)

    def forward(self, samples: NestedTensor):
        src = self.backbone(samples.tensors)
        mask = F.interpolate(samples.mask[None].float(), size=src.shape[-2:]).to(torch.bool)[0]
        bs = src.shape[0]
        spatial_shapes = torch.as_tensor([src.shape[-2:]], dtype=torch.long)
        memory = src.flatten(2).transpose(1, 2)
        mask_flatten = mask.flatten(1)
        # valid ratios, as Deformable DETR computes them from the padding mask
        valid_H = torch.sum(~mask[:, :, 0], 1).float() / mask.shape[1]
        valid_W = torch.sum(~mask[:, 0, :], 1).float() / mask.shape[2]
        valid_ratios = torch.stack([valid_W, valid_H], -1)[:, None]  # bs, n_levels, 2
        tgt = self.query_feat.weight[None].expand(bs, -1, -1)
        ref = self.refpoint_embed.weight.sigmoid()[None].expand(bs, -1, -1)
        tgt = tgt + self.self_attn(tgt, tgt, tgt)[0]
        ref_input = (ref[:, :, None] * valid_ratios[:, None])
        return tgt + self.cross_attn(tgt, ref_input, memory, spatial_shapes, input_padding_mask=mask_flatten), mask


model = LWDETRLite().eval()
# a landscape and a portrait image whose sides are not multiples of the block size
images = [torch.rand(3, 80, 112) + 0.5, torch.rand(3, 112, 80) + 0.5]
if not FIXED:
    images = [pad_if_needed(img, BLOCK) for img in images]  # transform-level padding (before the fix)
samples = collate_fn(images)
with torch.no_grad():
    out, feat_mask = model(samples)
zero_cells = F.avg_pool2d(samples.tensors.abs().sum(1, keepdim=True), 16)[:, 0] == 0
unmasked_pad = (zero_cells & ~feat_mask).sum().item()
print(f"fixed={FIXED} all-zero padding cells the cross-attention treats as image: {unmasked_pad}; "
      f"decoder output norm {out.norm():.4f}")
