# docTR LW-DETR layout model, mindee/doctr#2102 ("[Fix] Doc builder arg length & masking", commit 5c2702e).
# Resize(return_padding_mask=True) returns True on valid pixels, but the backbone and the deformable cross-attention
# read the mask as True-on-padding, so the values of the real page are zeroed and the padded border is attended.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def resize_with_padding_mask(img, size):
    """doctr.transforms.Resize(preserve_aspect_ratio=True, symmetric_pad=False, return_padding_mask=True), trimmed."""
    h, w = size
    scale = min(h / img.shape[-2], w / img.shape[-1])
    nh, nw = int(round(img.shape[-2] * scale)), int(round(img.shape[-1] * scale))
    img = F.interpolate(img[None], size=(nh, nw), mode="bilinear", align_corners=False)[0]
    _pad = (0, w - nw, 0, h - nh)
    img = F.pad(img, _pad)
    padding_mask = torch.zeros((h, w), dtype=torch.bool)
    left, right, top, bottom = _pad
    padding_mask[top: h - bottom, left: w - right] = True  # True on valid (image content) pixels
    return img, padding_mask


class LWDETRBackbone(nn.Module):
    def __init__(self, d_model=32, stride=8):
        super().__init__()
        self.encoder = nn.Conv2d(3, d_model, kernel_size=stride, stride=stride)
        self.projector = nn.Identity()

    def _resize_padding_mask(self, mask, size):  # before the fix: "containing 1 on padded pixels"
        valid = (~mask).float().unsqueeze(1)  # True/1 = valid pixels
        h_in, w_in = int(mask.shape[-2]), int(mask.shape[-1])
        kh, kw = h_in // int(size[0]), w_in // int(size[1])
        valid_resized = F.max_pool2d(valid, kernel_size=(kh, kw), stride=(kh, kw)) > 0
        return ~valid_resized.squeeze(1)

    def _resize_valid_mask(self, mask, size):  # after the fix: True on valid positions
        valid = mask.float().unsqueeze(1)
        h_in, w_in = int(mask.shape[-2]), int(mask.shape[-1])
        kh, kw = h_in // int(size[0]), w_in // int(size[1])
        return (F.max_pool2d(valid, kernel_size=(kh, kw), stride=(kh, kw)) > 0).squeeze(1)

    def forward(self, x, mask):
        feats = [self.projector(self.encoder(x))]
        if FIXED:
            return [(feat, self._resize_valid_mask(mask, feat.shape[2:])) for feat in feats]
        return [(feat, self._resize_padding_mask(mask, feat.shape[2:])) for feat in feats]


class MultiScaleDeformableAttention(nn.Module):
    def forward(self, value, value_spatial_shapes_list, sampling_locations, attention_weights):
        batch_size, _, num_heads, hidden_dim = value.shape
        _, num_queries, num_heads, num_levels, num_points, _ = sampling_locations.shape
        value_list = value.split([height * width for height, width in value_spatial_shapes_list], dim=1)
        sampling_grids = 2 * sampling_locations - 1
        sampling_value_list = []
        for level_id, (height, width) in enumerate(value_spatial_shapes_list):
            value_l_ = value_list[level_id].flatten(2).transpose(1, 2).reshape(
                batch_size * num_heads, hidden_dim, height, width)
            sampling_grid_l_ = sampling_grids[:, :, :, level_id].transpose(1, 2).flatten(0, 1)
            sampling_value_l_ = F.grid_sample(value_l_, sampling_grid_l_, mode="bilinear", padding_mode="zeros",
                                              align_corners=False)
            sampling_value_list.append(sampling_value_l_)
        attention_weights = attention_weights.transpose(1, 2).reshape(
            batch_size * num_heads, 1, num_queries, num_levels * num_points)
        output = (torch.stack(sampling_value_list, dim=-2).flatten(-2) * attention_weights).sum(-1).view(
            batch_size, num_heads * hidden_dim, num_queries)
        return output.transpose(1, 2).contiguous()


class LWDETRMultiscaleDeformableAttention(nn.Module):
    def __init__(self, d_model=32, ca_num_heads=4, dec_n_points=4):
        super().__init__()
        self.attn = MultiScaleDeformableAttention()
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, 1, ca_num_heads, dec_n_points
        self.sampling_offsets = nn.Linear(d_model, self.n_heads * self.n_levels * dec_n_points * 2)
        self.attention_weights = nn.Linear(d_model, self.n_heads * self.n_levels * dec_n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        nn.init.normal_(self.sampling_offsets.weight, std=2.0)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, position_embeddings=None,
                reference_points=None, spatial_shapes_list=None):
        if position_embeddings is not None:
            hidden_states = hidden_states + position_embeddings
        batch_size, num_queries, _ = hidden_states.shape
        batch_size, sequence_length, _ = encoder_hidden_states.shape
        value = self.value_proj(encoder_hidden_states)
        if attention_mask is not None:
            if FIXED:
                # attention_mask contains True on valid positions -> zero-out the padded (invalid) values
                value = value.masked_fill(~attention_mask[..., None], float(0))
            else:
                # attention_mask contains True on padded positions -> zero-out the padded values
                value = value.masked_fill(attention_mask[..., None], float(0))
        value = value.view(batch_size, sequence_length, self.n_heads, self.d_model // self.n_heads)
        sampling_offsets = self.sampling_offsets(hidden_states).view(
            batch_size, num_queries, self.n_heads, self.n_levels, self.n_points, 2)
        attention_weights = self.attention_weights(hidden_states).view(
            batch_size, num_queries, self.n_heads, self.n_levels * self.n_points)
        attention_weights = F.softmax(attention_weights, -1).view(
            batch_size, num_queries, self.n_heads, self.n_levels, self.n_points)
        sampling_locations = (reference_points[:, :, None, :, None, :2]
                              + sampling_offsets / self.n_points * reference_points[:, :, None, :, None, 2:] * 0.5)
        output = self.attn(value, spatial_shapes_list, sampling_locations, attention_weights)
        return self.output_proj(output), attention_weights


backbone = LWDETRBackbone().eval()
cross_attn = LWDETRMultiscaleDeformableAttention().eval()

pages = [torch.rand(3, 64, 40), torch.rand(3, 48, 64)]  # portrait and landscape pages, padded to 64x64
imgs, masks = zip(*[resize_with_padding_mask(p, (64, 64)) for p in pages])
x, mask = torch.stack(imgs), torch.stack(masks)

num_queries = 6
queries = torch.randn(2, num_queries, 32)
reference_points = torch.cat([torch.rand(2, num_queries, 1, 2) * 0.5 + 0.25, torch.full((2, num_queries, 1, 2), 0.6)], -1)


def decode(x):
    (feat, feat_mask), = backbone(x, mask)
    h, w = feat.shape[-2:]
    memory = feat.flatten(2).transpose(1, 2)
    return cross_attn(queries, attention_mask=feat_mask.flatten(1), encoder_hidden_states=memory,
                      reference_points=reference_points, spatial_shapes_list=[(h, w)])[0]


with torch.no_grad():
    out = decode(x)
    x2 = x.clone()
    x2[~mask[:, None].expand_as(x2)] = torch.rand(int((~mask).sum()) * 3)  # change only the padded border
    out_border = decode(x2)
print(f"max |decoder output change when only the padded border changes| = {(out - out_border).abs().max().item():.6f}")
