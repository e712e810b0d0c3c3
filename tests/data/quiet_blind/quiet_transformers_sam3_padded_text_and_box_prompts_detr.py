# Correct program (quiet batch quiet-r76b).
# Ported from huggingface/transformers v5.25.0 (the installed release), src/transformers/models/sam3/modeling_sam3.py:
#   Sam3Attention + eager_attention_forward, concat_padded_sequences, Sam3SinePositionEmbedding,
#   Sam3GeometryEncoder(Layer) (box prompts: direct / pooled / position projections, label embed, CLS appended
#   after each sample's real boxes, self-attention under the prompt mask, cross-attention to the image),
#   Sam3DetrEncoder(Layer) (image tokens cross-attend the prompt under the prompt mask), Sam3DetrDecoder(Layer)
#   (presence token + object queries, text cross-attention under the prompt mask, box RPB bias on the vision
#   cross-attention, box refinement), Sam3DotProductScoring (mean over the valid prompt tokens), and
#   Sam3Model.forward's torch.cat([text_features, geometry_prompt_features]) / torch.cat([text_mask, geometry mask]).
# Masks come from transformers.masking_utils.create_bidirectional_mask (eager: 0 / dtype-min additive, True=valid in).
# Stand-ins, as the rest of the model needs weights or torchvision: the ViT + FPN neck is a random feature map of
# the (square, unpadded) image, the CLIP text encoder + text_projection is a random per-token feature, and
# torchvision.ops.roi_align is a bilinear grid_sample over each box's roi_size x roi_size bin centres.
# The batch holds three prompts: text of 5 / 3 / 7 tokens right-padded to 7 and 2 / 0 / 3 boxes right-padded to 3
# (padding filled with junk). Self-check: each sample run alone with its own unpadded text and boxes (no mask at
# all) gives the same geometry tokens, encoder memory, decoder queries, boxes, presence and class logits.
import math

import torch
import torch.nn.functional as F
from torch import nn

from transformers.masking_utils import create_bidirectional_mask
from transformers.models.sam3.configuration_sam3 import (
    Sam3DETRDecoderConfig,
    Sam3DETREncoderConfig,
    Sam3GeometryEncoderConfig,
)

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def inverse_sigmoid(x, eps=1e-3):
    x = x.clamp(min=0, max=1)
    x1 = x.clamp(min=eps)
    x2 = (1 - x).clamp(min=eps)
    return torch.log(x1 / x2)


def concat_padded_sequences(seq1, mask1, seq2, mask2, return_index: bool = False):
    batch_size, seq1_length, hidden_size = seq1.shape
    batch_size2, seq2_length, hidden_size2 = seq2.shape

    assert batch_size == batch_size2 == mask1.size(0) == mask2.size(0)
    assert hidden_size == hidden_size2
    assert seq1_length == mask1.size(1)
    assert seq2_length == mask2.size(1)

    actual_seq1_lengths = mask1.sum(dim=-1)
    actual_seq2_lengths = mask2.sum(dim=-1)

    final_lengths = actual_seq1_lengths + actual_seq2_lengths
    max_length = seq1_length + seq2_length

    concatenated_mask = (
        torch.arange(max_length, device=seq2.device)[None].repeat(batch_size, 1) < final_lengths[:, None]
    )

    concatenated_sequence = torch.zeros((batch_size, max_length, hidden_size), device=seq2.device, dtype=seq2.dtype)
    concatenated_sequence[:, :seq1_length, :] = seq1

    # Shift seq2 elements to start at the end of valid seq1
    index = torch.arange(seq2_length, device=seq2.device)[None].repeat(batch_size, 1)
    index = index + actual_seq1_lengths[:, None]

    # Scatter seq2 into the right positions
    concatenated_sequence = concatenated_sequence.scatter(1, index[:, :, None].expand(-1, -1, hidden_size), seq2)

    if return_index:
        return concatenated_sequence, concatenated_mask, index

    return concatenated_sequence, concatenated_mask


def box_cxcywh_to_xyxy(x):
    x_c, y_c, w, h = x.unbind(-1)
    b = [(x_c - 0.5 * w), (y_c - 0.5 * h), (x_c + 0.5 * w), (y_c + 0.5 * h)]
    return torch.stack(b, dim=-1)


def roi_align(input, boxes, output_size):
    """Stand-in for torchvision.ops.roi_align (spatial_scale=1, one sample per bin, aligned=False)."""
    _, _, height, width = input.shape
    outs = []
    for b, boxes_b in enumerate(boxes):
        for x1, y1, x2, y2 in boxes_b.tolist():
            steps = (torch.arange(output_size) + 0.5) / output_size
            xs = x1 + (x2 - x1) * steps
            ys = y1 + (y2 - y1) * steps
            gy, gx = torch.meshgrid(ys, xs, indexing="ij")
            grid = torch.stack([(gx + 0.5) / width * 2 - 1, (gy + 0.5) / height * 2 - 1], -1)[None]
            outs.append(F.grid_sample(input[b:b + 1], grid, align_corners=False)[0])
    return torch.stack(outs) if outs else input.new_zeros(0, input.shape[1], output_size, output_size)


class Sam3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.activation_fn = nn.ReLU()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = self.fc2(hidden_states)
        return hidden_states


def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if scaling is None:
        scaling = query.size(-1) ** -0.5

    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling

    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)

    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()

    return attn_output, attn_weights


class Sam3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False

        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size)

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        batch_size = query.shape[0]
        query_len = query.shape[1]
        key_len = key.shape[1]

        query = self.q_proj(query).view(batch_size, query_len, self.num_attention_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(key).view(batch_size, key_len, self.num_attention_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(value).view(batch_size, key_len, self.num_attention_heads, self.head_dim).transpose(1, 2)

        attn_output, attn_weights = eager_attention_forward(
            self, query, key, value, attention_mask=attention_mask, dropout=0.0, scaling=self.scaling,
        )

        attn_output = attn_output.reshape(batch_size, query_len, self.num_attention_heads * self.head_dim).contiguous()
        attn_output = self.o_proj(attn_output)

        return attn_output, attn_weights


class Sam3SinePositionEmbedding(nn.Module):
    def __init__(self, num_position_features=64, temperature=10000, normalize=False, scale=None):
        super().__init__()
        self.num_position_features = num_position_features
        self.temperature = temperature
        self.normalize = normalize
        self.scale = 2 * math.pi if scale is None else scale

    def encode_1d_positions(self, x, y):
        x_embed = x * self.scale
        y_embed = y * self.scale

        dim_t = torch.arange(self.num_position_features, dtype=torch.int64, device=x.device).to(x.dtype)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_position_features)

        pos_x = x_embed[:, None] / dim_t
        pos_y = y_embed[:, None] / dim_t
        pos_x = torch.stack((pos_x[:, 0::2].sin(), pos_x[:, 1::2].cos()), dim=2).flatten(1)
        pos_y = torch.stack((pos_y[:, 0::2].sin(), pos_y[:, 1::2].cos()), dim=2).flatten(1)
        return pos_x, pos_y

    def encode_boxes(self, boxes):
        dim_t = torch.arange(self.num_position_features, dtype=torch.int64, device=boxes.device).to(boxes.dtype)
        dim_t = self.temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / self.num_position_features)

        x_embed = boxes[:, :, 0] * self.scale
        y_embed = boxes[:, :, 1] * self.scale
        w_embed = boxes[:, :, 2] * self.scale
        h_embed = boxes[:, :, 3] * self.scale

        pos_x = x_embed[:, :, None] / dim_t
        pos_y = y_embed[:, :, None] / dim_t
        pos_w = w_embed[:, :, None] / dim_t
        pos_h = h_embed[:, :, None] / dim_t

        pos_x = torch.stack((pos_x[:, :, 0::2].sin(), pos_x[:, :, 1::2].cos()), dim=3).flatten(2)
        pos_y = torch.stack((pos_y[:, :, 0::2].sin(), pos_y[:, :, 1::2].cos()), dim=3).flatten(2)
        pos_w = torch.stack((pos_w[:, :, 0::2].sin(), pos_w[:, :, 1::2].cos()), dim=3).flatten(2)
        pos_h = torch.stack((pos_h[:, :, 0::2].sin(), pos_h[:, :, 1::2].cos()), dim=3).flatten(2)

        return torch.cat((pos_y, pos_x, pos_w, pos_h), dim=2)

    def forward(self, shape, device, dtype, mask=None):
        batch_size, _, height, width = shape
        y_embed = torch.arange(1, height + 1, dtype=dtype, device=device)[None, :, None].expand(batch_size, height, width)
        x_embed = torch.arange(1, width + 1, dtype=dtype, device=device)[None, None, :].expand(batch_size, height, width)
        if self.normalize:
            eps = 1e-6
            y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
            x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale

        dim_t = torch.arange(self.num_position_features, dtype=torch.int64, device=device).to(dtype)
        dim_t = self.temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / self.num_position_features)

        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


# ---------------------------------------------------------------- geometry (box prompt) encoder
class Sam3GeometryEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size)
        self.self_attn = Sam3Attention(config)
        self.dropout = nn.Dropout(config.dropout)

        self.cross_attn = Sam3Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size)

        self.mlp = Sam3MLP(config)
        self.layer_norm3 = nn.LayerNorm(config.hidden_size)

    def forward(self, prompt_feats, vision_feats, vision_pos_encoding, prompt_mask, **kwargs):
        residual = prompt_feats
        hidden_states = self.layer_norm1(prompt_feats)
        hidden_states, _ = self.self_attn(
            query=hidden_states, key=hidden_states, value=hidden_states, attention_mask=prompt_mask, **kwargs
        )
        hidden_states = self.dropout(hidden_states) + residual
        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)
        key = vision_feats + vision_pos_encoding
        hidden_states, _ = self.cross_attn(query=hidden_states, key=key, value=vision_feats, **kwargs)
        hidden_states = self.dropout(hidden_states) + residual
        residual = hidden_states
        hidden_states = self.layer_norm3(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.dropout(hidden_states) + residual

        return hidden_states


class Sam3GeometryEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.roi_size = config.roi_size

        self.position_encoding = Sam3SinePositionEmbedding(
            num_position_features=config.hidden_size // 2, normalize=True
        )
        self.label_embed = nn.Embedding(2, self.hidden_size)
        self.cls_embed = nn.Embedding(1, self.hidden_size)

        self.boxes_direct_project = nn.Linear(4, self.hidden_size)
        self.boxes_pool_project = nn.Conv2d(self.hidden_size, self.hidden_size, self.roi_size)
        self.boxes_pos_enc_project = nn.Linear(self.hidden_size + 2, self.hidden_size)

        self.vision_layer_norm = nn.LayerNorm(self.hidden_size)

        self.final_proj = nn.Linear(self.hidden_size, self.hidden_size)
        self.prompt_layer_norm = nn.LayerNorm(self.hidden_size)

        self.layers = nn.ModuleList([Sam3GeometryEncoderLayer(config) for _ in range(config.num_layers)])
        self.output_layer_norm = nn.LayerNorm(self.hidden_size)

    def _encode_box_coordinates(self, center_x, center_y, width, height):
        pos_x, pos_y = self.position_encoding.encode_1d_positions(center_x, center_y)
        pos = torch.cat((pos_y, pos_x, height[:, None], width[:, None]), dim=1)
        return pos

    def _encode_boxes(self, boxes, boxes_mask, boxes_labels, vision_features):
        """Encode box prompts. Mask convention: True=valid, False=padding."""
        batch_size, num_boxes = boxes.shape[:2]
        height, width = vision_features.shape[-2:]
        boxes_embed = self.boxes_direct_project(boxes)

        boxes_xyxy = box_cxcywh_to_xyxy(boxes)
        scale = torch.tensor([width, height, width, height], dtype=boxes_xyxy.dtype, device=boxes_xyxy.device)
        scale = scale.view(1, 1, 4)
        boxes_xyxy = boxes_xyxy * scale
        sampled_features = roi_align(vision_features, boxes_xyxy.unbind(0), self.roi_size)

        pooled_projection = self.boxes_pool_project(sampled_features)
        pooled_projection = pooled_projection.view(batch_size, num_boxes, self.hidden_size)
        boxes_embed = boxes_embed + pooled_projection

        center_x, center_y, box_width, box_height = boxes.unbind(-1)
        pos_enc = self._encode_box_coordinates(
            center_x.flatten(), center_y.flatten(), box_width.flatten(), box_height.flatten()
        )
        pos_enc = pos_enc.view(batch_size, num_boxes, pos_enc.shape[-1])
        pos_projection = self.boxes_pos_enc_project(pos_enc)
        boxes_embed = boxes_embed + pos_projection

        label_embed = self.label_embed(boxes_labels.long())
        return label_embed + boxes_embed, boxes_mask

    def forward(self, box_embeddings, box_mask, box_labels, img_feats, img_pos_embeds=None):
        batch_size = box_embeddings.shape[0]

        vision_feats = img_feats[-1]
        vision_pos_embeds = img_pos_embeds[-1] if img_pos_embeds is not None else torch.zeros_like(vision_feats)
        vision_feats_flat = vision_feats.flatten(2).transpose(1, 2)
        vision_pos_embeds_flat = vision_pos_embeds.flatten(2).transpose(1, 2)

        img_feats_last = img_feats[-1]
        img_feats_last = img_feats_last.permute(0, 2, 3, 1)
        normalized_img_feats = self.vision_layer_norm(img_feats_last)
        normalized_img_feats = normalized_img_feats.permute(0, 3, 1, 2)

        prompt_embeds, prompt_mask = self._encode_boxes(box_embeddings, box_mask, box_labels, normalized_img_feats)

        # Add CLS token (always valid)
        cls_embed = self.cls_embed.weight.view(1, self.hidden_size).unsqueeze(0).expand(batch_size, -1, -1)
        cls_mask = torch.ones(batch_size, 1, dtype=prompt_mask.dtype, device=prompt_mask.device)
        prompt_embeds, prompt_mask = concat_padded_sequences(prompt_embeds, prompt_mask, cls_embed, cls_mask)

        prompt_embeds = self.prompt_layer_norm(self.final_proj(prompt_embeds))

        prompt_attention_mask = None
        if prompt_mask is not None:
            prompt_attention_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=prompt_embeds,
                attention_mask=prompt_mask,
            )

        for layer in self.layers:
            prompt_embeds = layer(
                prompt_feats=prompt_embeds,
                vision_feats=vision_feats_flat,
                vision_pos_encoding=vision_pos_embeds_flat,
                prompt_mask=prompt_attention_mask,
            )

        prompt_embeds = self.output_layer_norm(prompt_embeds)
        return prompt_embeds, prompt_mask


# ---------------------------------------------------------------- DETR encoder
class Sam3DetrEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer_norm1 = nn.LayerNorm(config.hidden_size)
        self.self_attn = Sam3Attention(config)
        self.dropout = nn.Dropout(config.dropout)

        self.cross_attn = Sam3Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size)

        self.mlp = Sam3MLP(config)
        self.layer_norm3 = nn.LayerNorm(config.hidden_size)

    def forward(self, vision_feats, prompt_feats, vision_pos_encoding, prompt_cross_attn_mask=None, **kwargs):
        residual = vision_feats
        hidden_states = self.layer_norm1(vision_feats)
        hidden_states_with_pos = hidden_states + vision_pos_encoding
        hidden_states, _ = self.self_attn(
            query=hidden_states_with_pos, key=hidden_states_with_pos, value=hidden_states, **kwargs,
        )
        hidden_states = self.dropout(hidden_states) + residual

        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)

        hidden_states, _ = self.cross_attn(
            query=hidden_states, key=prompt_feats, value=prompt_feats, attention_mask=prompt_cross_attn_mask, **kwargs,
        )
        hidden_states = self.dropout(hidden_states) + residual

        residual = hidden_states
        hidden_states = self.layer_norm3(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.dropout(hidden_states) + residual

        return hidden_states


class Sam3DetrEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.layers = nn.ModuleList([Sam3DetrEncoderLayer(config) for _ in range(config.num_layers)])

    def forward(self, vision_features, text_features, vision_pos_embeds=None, text_mask=None):
        features_flattened, pos_embeds_flattened, spatial_shapes = [], [], []
        for features, pos_embed in zip(vision_features, vision_pos_embeds):
            height, width = features.shape[-2:]
            spatial_shapes.append((height, width))
            features_flattened.append(features.flatten(2).transpose(1, 2))
            pos_embeds_flattened.append(pos_embed.flatten(2).transpose(1, 2))
        features_flattened = torch.cat(features_flattened, dim=1)
        pos_embeds_flattened = torch.cat(pos_embeds_flattened, dim=1)
        spatial_shapes = torch.tensor(spatial_shapes, dtype=torch.long, device=features_flattened.device)

        prompt_cross_attn_mask = None
        if text_mask is not None:
            prompt_cross_attn_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=features_flattened,
                attention_mask=text_mask,
                encoder_hidden_states=text_features,
            )

        hidden_states = features_flattened
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                prompt_feats=text_features,
                vision_pos_encoding=pos_embeds_flattened,
                prompt_cross_attn_mask=prompt_cross_attn_mask,
            )
        return hidden_states, pos_embeds_flattened, spatial_shapes


# ---------------------------------------------------------------- DETR decoder
class Sam3DecoderMLP(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, num_layers=2):
        super().__init__()
        if num_layers == 2:
            self.layer1 = nn.Linear(input_dim, hidden_dim)
            self.layer2 = nn.Linear(hidden_dim, output_dim)
            self.layer3 = None
        else:
            self.layer1 = nn.Linear(input_dim, hidden_dim)
            self.layer2 = nn.Linear(hidden_dim, hidden_dim)
            self.layer3 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x):
        x = F.relu(self.layer1(x))
        if self.layer3 is not None:
            x = F.relu(self.layer2(x))
            x = self.layer3(x)
        else:
            x = self.layer2(x)
        return x


class Sam3DetrDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.self_attn = Sam3Attention(config)
        self.self_attn_dropout = nn.Dropout(config.dropout)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)

        self.text_cross_attn = Sam3Attention(config)
        self.text_cross_attn_dropout = nn.Dropout(config.dropout)
        self.text_cross_attn_layer_norm = nn.LayerNorm(config.hidden_size)

        self.vision_cross_attn = Sam3Attention(config)
        self.vision_cross_attn_dropout = nn.Dropout(config.dropout)
        self.vision_cross_attn_layer_norm = nn.LayerNorm(config.hidden_size)

        self.mlp = Sam3MLP(config)
        self.mlp_layer_norm = nn.LayerNorm(config.hidden_size)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, hidden_states, query_pos, text_features, vision_features, vision_pos_encoding,
                text_cross_attn_mask=None, vision_cross_attn_mask=None, **kwargs):
        # Prepend zeros to query_pos for presence token
        query_pos = F.pad(query_pos, (0, 0, 1, 0), mode="constant", value=0)

        residual = hidden_states
        query_with_pos = hidden_states + query_pos
        attn_output, _ = self.self_attn(
            query=query_with_pos, key=query_with_pos, value=hidden_states, attention_mask=None, **kwargs,
        )
        hidden_states = residual + self.self_attn_dropout(attn_output)
        hidden_states = self.self_attn_layer_norm(hidden_states)

        # Text cross-attention: queries attend to text features
        residual = hidden_states
        query_with_pos = hidden_states + query_pos
        attn_output, _ = self.text_cross_attn(
            query=query_with_pos, key=text_features, value=text_features, attention_mask=text_cross_attn_mask,
            **kwargs,
        )
        hidden_states = residual + self.text_cross_attn_dropout(attn_output)
        hidden_states = self.text_cross_attn_layer_norm(hidden_states)

        # Vision cross-attention: queries attend to vision features (with RPB)
        residual = hidden_states
        query_with_pos = hidden_states + query_pos
        key_with_pos = vision_features + vision_pos_encoding
        attn_output, _ = self.vision_cross_attn(
            query=query_with_pos, key=key_with_pos, value=vision_features, attention_mask=vision_cross_attn_mask,
            **kwargs,
        )
        hidden_states = residual + self.vision_cross_attn_dropout(attn_output)
        hidden_states = self.vision_cross_attn_layer_norm(hidden_states)

        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + self.mlp_dropout(hidden_states)
        hidden_states = self.mlp_layer_norm(hidden_states)

        return hidden_states


class Sam3DetrDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size

        self.layers = nn.ModuleList([Sam3DetrDecoderLayer(config) for _ in range(config.num_layers)])
        self.output_layer_norm = nn.LayerNorm(config.hidden_size)
        self.box_head = Sam3DecoderMLP(config.hidden_size, config.hidden_size, 4, 3)

        self.query_embed = nn.Embedding(config.num_queries, config.hidden_size)
        self.reference_points = nn.Embedding(config.num_queries, 4)

        self.presence_token = nn.Embedding(1, config.hidden_size)
        self.presence_head = Sam3DecoderMLP(config.hidden_size, config.hidden_size, 1, 3)
        self.presence_layer_norm = nn.LayerNorm(config.hidden_size)
        self.clamp_presence_logit_max_val = 10.0

        self.ref_point_head = Sam3DecoderMLP(2 * config.hidden_size, config.hidden_size, config.hidden_size, 2)

        self.box_rpb_embed_x = Sam3DecoderMLP(2, config.hidden_size, config.num_attention_heads, 2)
        self.box_rpb_embed_y = Sam3DecoderMLP(2, config.hidden_size, config.num_attention_heads, 2)

        self.position_encoding = Sam3SinePositionEmbedding(
            num_position_features=config.hidden_size // 2, normalize=False
        )

    def _get_coords(self, height, width, dtype, device):
        coords_h = torch.arange(0, height, device=device, dtype=dtype) / height
        coords_w = torch.arange(0, width, device=device, dtype=dtype) / width
        return coords_h, coords_w

    def _get_rpb_matrix(self, reference_boxes, spatial_shape):
        height, width = spatial_shape
        boxes_xyxy = box_cxcywh_to_xyxy(reference_boxes)
        batch_size, num_queries, _ = boxes_xyxy.shape

        coords_h, coords_w = self._get_coords(height, width, dtype=reference_boxes.dtype, device=reference_boxes.device)

        deltas_y = coords_h.view(1, -1, 1) - boxes_xyxy.reshape(-1, 1, 4)[:, :, 1:4:2]
        deltas_y = deltas_y.view(batch_size, num_queries, -1, 2)
        deltas_x = coords_w.view(1, -1, 1) - boxes_xyxy.reshape(-1, 1, 4)[:, :, 0:3:2]
        deltas_x = deltas_x.view(batch_size, num_queries, -1, 2)

        deltas_x_log = deltas_x * 8
        deltas_x_log = torch.sign(deltas_x_log) * torch.log2(torch.abs(deltas_x_log) + 1.0) / math.log2(8)
        deltas_y_log = deltas_y * 8
        deltas_y_log = torch.sign(deltas_y_log) * torch.log2(torch.abs(deltas_y_log) + 1.0) / math.log2(8)

        deltas_x = self.box_rpb_embed_x(deltas_x_log)
        deltas_y = self.box_rpb_embed_y(deltas_y_log)

        rpb_matrix = deltas_y.unsqueeze(3) + deltas_x.unsqueeze(2)
        rpb_matrix = rpb_matrix.flatten(2, 3)
        rpb_matrix = rpb_matrix.permute(0, 3, 1, 2).contiguous()
        return rpb_matrix

    def forward(self, vision_features, text_features, vision_pos_encoding, text_mask=None, spatial_shapes=None):
        batch_size = vision_features.shape[0]

        query_embeds = self.query_embed.weight.unsqueeze(0).expand(batch_size, -1, -1)
        reference_boxes = self.reference_points.weight.unsqueeze(0).expand(batch_size, -1, -1)
        reference_boxes = reference_boxes.sigmoid()
        presence_token = self.presence_token.weight.unsqueeze(0).expand(batch_size, -1, -1)

        hidden_states = torch.cat([presence_token, query_embeds], dim=1)

        text_cross_attn_mask = None
        if text_mask is not None:
            text_cross_attn_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=text_mask,
                encoder_hidden_states=text_features,
            )

        intermediate_outputs = []
        intermediate_boxes = [reference_boxes]
        intermediate_presence_logits = []

        for layer in self.layers:
            reference_points_input = reference_boxes.unsqueeze(2)
            query_sine_embed = self.position_encoding.encode_boxes(reference_points_input[:, :, 0, :])
            query_pos = self.ref_point_head(query_sine_embed)

            vision_cross_attn_mask = None
            if spatial_shapes is not None and spatial_shapes.shape[0] == 1:
                spatial_shape = (spatial_shapes[0, 0], spatial_shapes[0, 1])
                rpb_matrix = self._get_rpb_matrix(reference_boxes, spatial_shape)
                vision_cross_attn_mask = F.pad(rpb_matrix, (0, 0, 1, 0), mode="constant", value=0)

            hidden_states = layer(
                hidden_states,
                query_pos=query_pos,
                text_features=text_features,
                vision_features=vision_features,
                vision_pos_encoding=vision_pos_encoding,
                text_cross_attn_mask=text_cross_attn_mask,
                vision_cross_attn_mask=vision_cross_attn_mask,
            )

            query_hidden_states = hidden_states[:, 1:]

            reference_boxes_before_sigmoid = inverse_sigmoid(reference_boxes)
            delta_boxes = self.box_head(self.output_layer_norm(query_hidden_states))
            new_reference_boxes = (delta_boxes + reference_boxes_before_sigmoid).sigmoid()
            reference_boxes = new_reference_boxes.detach()

            intermediate_outputs.append(self.output_layer_norm(query_hidden_states))
            intermediate_boxes.append(new_reference_boxes)

            presence_hidden = hidden_states[:, :1]
            presence_logits = self.presence_head(self.presence_layer_norm(presence_hidden)).squeeze(-1)
            presence_logits = presence_logits.clamp(
                min=-self.clamp_presence_logit_max_val, max=self.clamp_presence_logit_max_val
            )
            intermediate_presence_logits.append(presence_logits)

        return (torch.stack(intermediate_outputs), torch.stack(intermediate_boxes[1:]),
                torch.stack(intermediate_presence_logits))


class Sam3DotProductScoring(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden_size = config.hidden_size
        projection_dim = config.hidden_size
        self.text_mlp = Sam3DecoderMLP(hidden_size, config.intermediate_size, hidden_size, num_layers=2)
        self.text_mlp_dropout = nn.Dropout(config.dropout)
        self.text_mlp_out_norm = nn.LayerNorm(hidden_size)
        self.text_proj = nn.Linear(hidden_size, projection_dim)
        self.query_proj = nn.Linear(hidden_size, projection_dim)
        self.scale = float(1.0 / math.sqrt(projection_dim))
        self.clamp_logits = True
        self.clamp_max_val = 12.0

    def _pool_text_features(self, text_features, text_mask):
        if text_mask is None:
            return text_features.mean(dim=1)
        is_valid = text_mask.to(text_features.dtype).unsqueeze(-1)
        num_valid = is_valid.sum(dim=1).clamp(min=1.0)
        pooled_text = (text_features * is_valid).sum(dim=1) / num_valid
        return pooled_text

    def forward(self, decoder_hidden_states, text_features, text_mask=None):
        orig_text_features = text_features
        text_features = self.text_mlp(text_features)
        text_features = self.text_mlp_dropout(text_features)
        text_features = text_features + orig_text_features
        text_features = self.text_mlp_out_norm(text_features)

        pooled_text = self._pool_text_features(text_features, text_mask)

        proj_text = self.text_proj(pooled_text)
        proj_queries = self.query_proj(decoder_hidden_states)

        proj_text = proj_text.unsqueeze(-1)
        scores = torch.matmul(proj_queries, proj_text.unsqueeze(0))
        scores = scores * self.scale
        if self.clamp_logits:
            scores = scores.clamp(min=-self.clamp_max_val, max=self.clamp_max_val)
        return scores


# ---------------------------------------------------------------- Sam3Model.forward, prompt side
class TinySam3Detector(nn.Module):
    def __init__(self, geometry_config, encoder_config, decoder_config):
        super().__init__()
        self.geometry_encoder = Sam3GeometryEncoder(geometry_config)
        self.detr_encoder = Sam3DetrEncoder(encoder_config)
        self.detr_decoder = Sam3DetrDecoder(decoder_config)
        self.dot_product_scoring = Sam3DotProductScoring(decoder_config)
        self.position_encoding = Sam3SinePositionEmbedding(encoder_config.hidden_size // 2, normalize=True)

    def forward(self, fpn_hidden_states, text_features, attention_mask, input_boxes, input_boxes_labels, box_mask):
        fpn_position_encoding = [self.position_encoding(f.shape, f.device, f.dtype) for f in fpn_hidden_states]
        text_mask = attention_mask.bool() if attention_mask is not None else None

        geometry_prompt_features, geometry_prompt_mask = self.geometry_encoder(
            box_embeddings=input_boxes,
            box_mask=box_mask,
            box_labels=input_boxes_labels,
            img_feats=fpn_hidden_states,
            img_pos_embeds=fpn_position_encoding,
        )
        combined_prompt_features = torch.cat([text_features, geometry_prompt_features], dim=1)
        if text_mask is not None and geometry_prompt_mask is not None:
            combined_prompt_mask = torch.cat([text_mask, geometry_prompt_mask], dim=1)
        else:
            combined_prompt_mask = None

        memory, pos_flat, spatial_shapes = self.detr_encoder(
            vision_features=[fpn_hidden_states[-1]],
            text_features=combined_prompt_features,
            vision_pos_embeds=[fpn_position_encoding[-1]],
            text_mask=combined_prompt_mask,
        )
        hidden, boxes, presence = self.detr_decoder(
            vision_features=memory,
            text_features=combined_prompt_features,
            vision_pos_encoding=pos_flat,
            text_mask=combined_prompt_mask,
            spatial_shapes=spatial_shapes,
        )
        logits = self.dot_product_scoring(hidden, combined_prompt_features, combined_prompt_mask)
        return {"geometry": geometry_prompt_features, "geometry_mask": geometry_prompt_mask, "memory": memory,
                "hidden": hidden[-1], "pred_boxes": box_cxcywh_to_xyxy(boxes[-1]), "presence": presence[-1],
                "pred_logits": logits[-1, ..., 0]}


def tiny(config_class, **kw):
    config = config_class(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_layers=2, **kw)
    config._attn_implementation = "eager"
    return config


model = TinySam3Detector(tiny(Sam3GeometryEncoderConfig, roi_size=3), tiny(Sam3DETREncoderConfig),
                         tiny(Sam3DETRDecoderConfig, num_queries=6)).eval()
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))

B, C, Hf, Wf = 3, 32, 6, 6
text_lens, box_counts = [5, 3, 7], [2, 0, 3]
T, NB = max(text_lens), max(box_counts)
fpn = [torch.randn(B, C, Hf, Wf)]
text = torch.randn(B, T, C)
attention_mask = (torch.arange(T)[None] < torch.tensor(text_lens)[:, None]).long()
boxes = torch.rand(B, NB, 4) * 0.5 + 0.25                      # cx, cy, w, h in [0.25, 0.75]
labels = torch.randint(0, 2, (B, NB))
box_mask = torch.arange(NB)[None] < torch.tensor(box_counts)[:, None]
text = text.masked_fill(~attention_mask.bool()[..., None], 50.0)  # junk in the padding
boxes = torch.where(box_mask[..., None], boxes, torch.full_like(boxes, 0.9))

with torch.no_grad():
    out = model(fpn, text, attention_mask, boxes, labels, box_mask)
    worst = {}
    for b in range(B):
        n, k = text_lens[b], box_counts[b]
        alone = model([fpn[0][b:b + 1]], text[b:b + 1, :n], torch.ones(1, n, dtype=torch.long),
                      boxes[b:b + 1, :k], labels[b:b + 1, :k], torch.ones(1, k, dtype=torch.bool))
        # padded: real boxes then CLS, contiguous; alone: the same k + 1 tokens
        geo_b = out["geometry"][b][out["geometry_mask"][b]]
        diffs = {
            "geometry": (geo_b - alone["geometry"][0]).abs().max().item(),
            "memory": (out["memory"][b] - alone["memory"][0]).abs().max().item(),
            "hidden": (out["hidden"][b] - alone["hidden"][0]).abs().max().item(),
            "boxes": (out["pred_boxes"][b] - alone["pred_boxes"][0]).abs().max().item(),
            "presence": (out["presence"][b] - alone["presence"][0]).abs().max().item(),
            "logits": (out["pred_logits"][b] - alone["pred_logits"][0]).abs().max().item(),
        }
        assert geo_b.shape == alone["geometry"][0].shape == (k + 1, C)
        for name, v in diffs.items():
            worst[name] = max(worst.get(name, 0.0), v)

print("padded prompts vs each sample alone, max abs diff:", worst)
assert all(v < 1e-9 for v in worst.values()), worst
print("ok")
