# huggingface/transformers PR #20958 (Deformable DETR, modeling_deformable_detr.py).
# get_valid_ratio counted ~mask, but HF's pixel mask is True on real pixels, so the "valid ratio" of each
# padded image was the ratio of its *padding*; encoder reference points and sampling locations go off-image.
import sys
import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def multi_scale_deformable_attention(value, value_spatial_shapes, sampling_locations, attention_weights):
    batch_size, _, num_heads, hidden_dim = value.shape
    _, num_queries, num_heads, num_levels, num_points, _ = sampling_locations.shape
    value_list = value.split([h * w for h, w in value_spatial_shapes], dim=1)
    sampling_grids = 2 * sampling_locations - 1
    sampling_value_list = []
    for level_id, (height, width) in enumerate(value_spatial_shapes):
        value_l_ = value_list[level_id].flatten(2).transpose(1, 2).reshape(batch_size * num_heads, hidden_dim, height, width)
        sampling_grid_l_ = sampling_grids[:, :, :, level_id].transpose(1, 2).flatten(0, 1)
        sampling_value_l_ = F.grid_sample(value_l_, sampling_grid_l_, mode="bilinear", padding_mode="zeros", align_corners=False)
        sampling_value_list.append(sampling_value_l_)
    attention_weights = attention_weights.transpose(1, 2).reshape(batch_size * num_heads, 1, num_queries, num_levels * num_points)
    output = (torch.stack(sampling_value_list, dim=-2).flatten(-2) * attention_weights).sum(-1).view(batch_size, num_heads * hidden_dim, num_queries)
    return output.transpose(1, 2).contiguous()


class DeformableDetrMultiscaleDeformableAttention(nn.Module):
    def __init__(self, d_model=32, n_levels=2, n_heads=4, n_points=2):
        super().__init__()
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)

    def forward(self, hidden_states, attention_mask, position_embeddings, encoder_hidden_states, reference_points, spatial_shapes):
        hidden_states = hidden_states + position_embeddings
        batch_size, num_queries, _ = hidden_states.shape
        _, sequence_length, _ = encoder_hidden_states.shape
        value = self.value_proj(encoder_hidden_states)
        if attention_mask is not None:
            # we invert the attention_mask
            value = value.masked_fill(~attention_mask[..., None], float(0))
        value = value.view(batch_size, sequence_length, self.n_heads, self.d_model // self.n_heads)
        sampling_offsets = self.sampling_offsets(hidden_states).view(batch_size, num_queries, self.n_heads, self.n_levels, self.n_points, 2)
        attention_weights = self.attention_weights(hidden_states).view(batch_size, num_queries, self.n_heads, self.n_levels * self.n_points)
        attention_weights = F.softmax(attention_weights, -1).view(batch_size, num_queries, self.n_heads, self.n_levels, self.n_points)
        offset_normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
        sampling_locations = reference_points[:, :, None, :, None, :] + sampling_offsets / offset_normalizer[None, None, None, :, None, :]
        output = multi_scale_deformable_attention(value, spatial_shapes.tolist(), sampling_locations, attention_weights)
        return self.output_proj(output), sampling_locations


def get_reference_points(spatial_shapes, valid_ratios, device):
    # DeformableDetrEncoder.get_reference_points
    reference_points_list = []
    for level, (height, width) in enumerate(spatial_shapes):
        ref_y, ref_x = torch.meshgrid(
            torch.linspace(0.5, height - 0.5, height, dtype=torch.float32, device=device),
            torch.linspace(0.5, width - 0.5, width, dtype=torch.float32, device=device),
            indexing="ij",
        )
        ref_y = ref_y.reshape(-1)[None] / (valid_ratios[:, None, level, 1] * height)
        ref_x = ref_x.reshape(-1)[None] / (valid_ratios[:, None, level, 0] * width)
        ref = torch.stack((ref_x, ref_y), -1)
        reference_points_list.append(ref)
    reference_points = torch.cat(reference_points_list, 1)
    reference_points = reference_points[:, :, None] * valid_ratios[:, None]
    return reference_points


def get_valid_ratio(mask):
    """Get the valid ratio of all feature maps."""
    _, height, width = mask.shape
    if FIXED:
        valid_height = torch.sum(mask[:, :, 0], 1)
        valid_width = torch.sum(mask[:, 0, :], 1)
    else:
        valid_height = torch.sum(~mask[:, :, 0], 1)
        valid_width = torch.sum(~mask[:, 0, :], 1)
    valid_ratio_heigth = valid_height.float() / height
    valid_ratio_width = valid_width.float() / width
    valid_ratio = torch.stack([valid_ratio_width, valid_ratio_heigth], -1)
    return valid_ratio


d_model = 32
attn = DeformableDetrMultiscaleDeformableAttention(d_model).eval()
input_proj = nn.Conv2d(3, d_model, 1)
level_embed = torch.randn(2, d_model)
cross_attn = DeformableDetrMultiscaleDeformableAttention(d_model).eval()
num_queries = 10
query_position_embeddings = torch.randn(num_queries, d_model)
target_embeddings = torch.randn(num_queries, d_model)
reference_points_head = nn.Linear(d_model, 2)


def encoder_forward(pixel_values, pixel_mask, valid_ratios=None):
    # DeformableDetrModel.forward: features per level, masks interpolated from pixel_mask (True = real pixel)
    sources, masks = [], []
    for stride in (2, 4):
        feat = input_proj(F.avg_pool2d(pixel_values, stride))
        mask = F.interpolate(pixel_mask[None].float(), size=feat.shape[-2:]).to(torch.bool)[0]
        sources.append(feat)
        masks.append(mask)
    source_flatten, mask_flatten, lvl_pos, spatial_shapes = [], [], [], []
    for level, (source, mask) in enumerate(zip(sources, masks)):
        batch_size, num_channels, height, width = source.shape
        spatial_shapes.append((height, width))
        source_flatten.append(source.flatten(2).transpose(1, 2))
        mask_flatten.append(mask.flatten(1))
        lvl_pos.append(level_embed[level].view(1, 1, -1).expand(batch_size, height * width, -1))
    source_flatten = torch.cat(source_flatten, 1)
    mask_flatten = torch.cat(mask_flatten, 1)
    lvl_pos = torch.cat(lvl_pos, 1)
    spatial_shapes = torch.as_tensor(spatial_shapes, dtype=torch.long)
    if valid_ratios is None:
        valid_ratios = torch.stack([get_valid_ratio(m) for m in masks], 1)
    reference_points = get_reference_points(spatial_shapes, valid_ratios, source_flatten.device)
    out, loc = attn(source_flatten, mask_flatten, lvl_pos, source_flatten, reference_points, spatial_shapes)
    encoder_outputs = source_flatten + out

    # DeformableDetrDecoder: query reference points (sigmoid, relative to the image) scaled by valid_ratios
    batch_size = encoder_outputs.shape[0]
    query_pos = query_position_embeddings.unsqueeze(0).expand(batch_size, -1, -1)
    target = target_embeddings.unsqueeze(0).expand(batch_size, -1, -1)
    dec_reference_points = reference_points_head(query_pos).sigmoid()
    reference_points_input = dec_reference_points[:, :, None] * valid_ratios[:, None]
    dec_out, dec_loc = cross_attn(target, mask_flatten, query_pos, encoder_outputs, reference_points_input, spatial_shapes)
    return out, loc, spatial_shapes, masks, dec_out, dec_loc


with torch.no_grad():
    # padded batch: image 0 is 16x16, image 1 is 12x12 padded to 16x16 (pixel_mask True on real pixels)
    img0 = torch.randn(3, 16, 16)
    img1 = torch.randn(3, 12, 12)
    batch = torch.zeros(2, 3, 16, 16)
    pixel_mask = torch.zeros(2, 16, 16, dtype=torch.long)
    batch[0] = img0
    pixel_mask[0] = 1
    batch[1, :, :12, :12] = img1
    pixel_mask[1, :12, :12] = 1
    out_b, loc_b, shapes_b, masks_b, dec_b, dloc_b = encoder_forward(batch, pixel_mask)
    # reference: the same image alone, unpadded, whose valid ratio is 1 on every level by definition
    out_a, loc_a, shapes_a, masks_a, dec_a, dloc_a = encoder_forward(img1[None], torch.ones(1, 12, 12, dtype=torch.long), torch.ones(1, 2, 2))

    # compare the padded image's level-0 queries: sampling locations in pixel units, and outputs
    H0, W0 = shapes_b[0].tolist()
    h0, w0 = shapes_a[0].tolist()
    loc_b0 = loc_b[1, : H0 * W0].view(H0, W0, *loc_b.shape[2:])[:h0, :w0]
    loc_a0 = loc_a[0, : h0 * w0].view(h0, w0, *loc_a.shape[2:])
    pix_b = loc_b0 * shapes_b.flip(-1).float().view(1, 1, 1, -1, 1, 2)
    pix_a = loc_a0 * shapes_a.flip(-1).float().view(1, 1, 1, -1, 1, 2)
    out_b0 = out_b[1, : H0 * W0].view(H0, W0, -1)[:h0, :w0]
    out_a0 = out_a[0, : h0 * w0].view(h0, w0, -1)
    print("valid_ratios (w, h) per level of the 12x12 image padded to 16x16:", [get_valid_ratio(m)[1].tolist() for m in masks_b])
    print("max |encoder sampling location (pixels) padded-batch vs alone|: %.4f" % (pix_b - pix_a).abs().max().item())
    print("max |encoder output padded-batch vs alone| (valid tokens): %.4f" % (out_b0 - out_a0).abs().max().item())
    dpix_b = dloc_b[1] * shapes_b.flip(-1).float().view(1, 1, -1, 1, 2)
    dpix_a = dloc_a[0] * shapes_a.flip(-1).float().view(1, 1, -1, 1, 2)
    print("max |decoder sampling location (pixels) padded-batch vs alone|: %.4f" % (dpix_b - dpix_a).abs().max().item())
    print("max |decoder cross-attention output padded-batch vs alone|: %.4f" % (dec_b[1] - dec_a[0]).abs().max().item())
