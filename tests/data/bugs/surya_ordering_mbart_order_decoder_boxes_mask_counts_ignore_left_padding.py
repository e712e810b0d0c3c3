# surya reading-order model (VikParuchuri/surya commit f82a06e "Fix inference bugs"): MBartOrderDecoder prefill mask.
# Boxes are left-padded, but "all boxes attend to each other" was unmasked as columns [0, box_count), so real boxes
# attended the PAD boxes (and the last boxes were left causal); the fix unmasks [pad_len, max_boxes) from the processor.
import math
import sys
from copy import deepcopy

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BOX_SIZE = 64
TOKEN_SEP_ID = BOX_SIZE + 1
TOKEN_PAD_ID = BOX_SIZE + 2
D_MODEL, HEADS, LAYERS = 64, 4, 2


def process_boxes(boxes):
    # surya/model/ordering/processor.py OrderImageProcessor.process_boxes
    padded_boxes, box_masks, box_counts = [], [], []
    if not FIXED:
        max_boxes = max(len(b) for b in boxes) + 1
        for b in boxes:
            # Left pad for generation
            padded_b = deepcopy(b)
            padded_b.append([TOKEN_SEP_ID] * 4)  # Sep token to indicate start of label predictions
            box_mask = [0] * (max_boxes - len(b)) + [1] * len(b)
            padded_box = [[TOKEN_PAD_ID] * 4] * (max_boxes - len(b)) + b
            padded_boxes.append(padded_box)
            box_masks.append(box_mask)
            box_counts.append(len(b))
    else:
        for b in boxes:
            padded_b = deepcopy(b)
            padded_b.append([TOKEN_SEP_ID] * 4)
            padded_boxes.append(padded_b)
        max_boxes = max(len(b) for b in padded_boxes)
        for i in range(len(padded_boxes)):
            pad_len = max_boxes - len(padded_boxes[i])
            box_len = len(padded_boxes[i])
            box_mask = [0] * pad_len + [1] * box_len
            padded_box = [[TOKEN_PAD_ID] * 4] * pad_len + padded_boxes[i]
            padded_boxes[i] = padded_box
            box_masks.append(box_mask)
            box_counts.append([pad_len, max_boxes])
    return padded_boxes, box_masks, box_counts


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    # transformers.modeling_attn_mask_utils (4.3x) for a 2-D padding mask, eager path
    bsz, tgt_len = input_shape
    dtype = inputs_embeds.dtype
    min_val = torch.finfo(dtype).min
    causal = torch.full((tgt_len, tgt_len), min_val, dtype=dtype)
    cond = torch.arange(tgt_len)
    causal.masked_fill_(cond < (cond + 1).view(tgt_len, 1), 0)
    causal = causal[None, None].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)
    inverted = 1.0 - attention_mask[:, None, None, :].expand(bsz, 1, tgt_len, tgt_len).to(dtype)
    expanded = inverted.masked_fill(inverted.to(torch.bool), min_val)
    return causal.masked_fill(expanded.bool(), min_val)


class BboxEmbedding(nn.Module):
    def __init__(self, d_model, max_width=BOX_SIZE + 3):
        super().__init__()
        self.x1_embed = nn.Embedding(max_width, d_model)
        self.y1_embed = nn.Embedding(max_width, d_model)
        self.x2_embed = nn.Embedding(max_width, d_model)
        self.y2_embed = nn.Embedding(max_width, d_model)
        self.w_embed = nn.Embedding(max_width, d_model)
        self.h_embed = nn.Embedding(max_width, d_model)

    def forward(self, boxes):
        x1, y1, x2, y2 = boxes.unbind(dim=-1)
        w = (x2 - x1).clamp(min=0)
        h = (y2 - y1).clamp(min=0)
        return (self.x1_embed(x1) + self.y1_embed(y1) + self.x2_embed(x2) + self.y2_embed(y2)
                + self.w_embed(w) + self.h_embed(h))


class MBartAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.shape
        kv = hidden_states if key_value_states is None else key_value_states
        shape = lambda t: t.view(bsz, -1, self.heads, self.head_dim).transpose(1, 2)
        q = shape(self.q_proj(hidden_states) * self.scaling)
        k, v = shape(self.k_proj(kv)), shape(self.v_proj(kv))
        attn_weights = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = attn_weights.softmax(dim=-1)
        out = (attn_weights @ v).transpose(1, 2).reshape(bsz, tgt_len, -1)
        return self.out_proj(out)


class MBartDecoderLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.self_attn = MBartAttention(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = MBartAttention(d, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states):
        hidden_states = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask=attention_mask)
        hidden_states = hidden_states + self.encoder_attn(self.encoder_attn_layer_norm(hidden_states), encoder_hidden_states)
        return hidden_states + self.fc2(torch.relu(self.fc1(self.final_layer_norm(hidden_states))))


class MBartOrderDecoder(nn.Module):
    # surya/model/ordering/decoder.py (trimmed; eager / non-flash path)
    def __init__(self):
        super().__init__()
        self.embed_tokens = BboxEmbedding(D_MODEL)
        self.embed_scale = math.sqrt(D_MODEL)
        self.offset = 2
        self.embed_positions = nn.Embedding(64 + self.offset, D_MODEL)  # MBartLearnedPositionalEmbedding
        self.layernorm_embedding = nn.LayerNorm(D_MODEL)
        self.layers = nn.ModuleList([MBartDecoderLayer(D_MODEL, HEADS) for _ in range(LAYERS)])
        self.layer_norm = nn.LayerNorm(D_MODEL)

    def forward(self, input_boxes, input_boxes_mask, input_boxes_counts, encoder_hidden_states, past_key_values=None):
        input_shape = input_boxes.size()[:-1]
        past_key_values_length = 0
        inputs_embeds = self.embed_tokens(input_boxes) * self.embed_scale

        # 4d mask is passed through the layers
        attention_mask = _prepare_4d_causal_attention_mask(input_boxes_mask, input_shape, inputs_embeds, past_key_values_length)
        if past_key_values_length == 0:
            if FIXED:
                box_ends = input_boxes_counts[:, 1]
                box_starts = input_boxes_counts[:, 0]
                input_shape_arranged = torch.arange(input_shape[1], device=attention_mask.device)[None, :]
                # Enable all boxes to attend to each other (before the sep token)
                # Ensure that the boxes are not attending to the padding tokens
                boxes_end_mask = input_shape_arranged < box_ends[:, None]
                boxes_start_mask = input_shape_arranged >= box_starts[:, None]
                boxes_mask = boxes_end_mask & boxes_start_mask
            else:
                # Enable all boxes to attend to each other (before the sep token)
                boxes_mask = torch.arange(input_shape[1], device=attention_mask.device)[None, :] < input_boxes_counts[:, None]
            boxes_mask = boxes_mask.unsqueeze(1).unsqueeze(1)  # Enable proper broadcasting
            attention_mask = attention_mask.masked_fill(boxes_mask, 0)

        positions = self.embed_positions(torch.arange(past_key_values_length, past_key_values_length + input_shape[1]) + self.offset)
        hidden_states = self.layernorm_embedding(inputs_embeds + positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, encoder_hidden_states)
        return self.layer_norm(hidden_states)


decoder = MBartOrderDecoder().eval()
g = torch.Generator().manual_seed(1)


def rand_boxes(n):
    boxes = []
    for _ in range(n):
        x1, y1 = torch.randint(0, BOX_SIZE // 2, (2,), generator=g).tolist()
        boxes.append([x1, y1, x1 + int(torch.randint(1, BOX_SIZE // 2, (1,), generator=g)),
                      y1 + int(torch.randint(1, BOX_SIZE // 2, (1,), generator=g))])
    return boxes


pages = [rand_boxes(3), rand_boxes(7)]  # two pages with different numbers of layout boxes -> left padding
encoder_hidden_states = torch.randn(2, 16, D_MODEL)  # image encoder output (Donut-Swin in surya)

padded_boxes, box_masks, box_counts = process_boxes(pages)
input_boxes = torch.tensor(padded_boxes)
input_boxes_mask = torch.tensor(box_masks)
input_boxes_counts = torch.tensor(box_counts)

with torch.no_grad():
    out = decoder(input_boxes, input_boxes_mask, input_boxes_counts, encoder_hidden_states)
    # PAD boxes must not matter: change what sits in the padded slots and compare the real positions
    alt_boxes = input_boxes.clone()
    alt_boxes[input_boxes_mask == 0] = torch.tensor([3, 5, 40, 50])
    out_alt = decoder(alt_boxes, input_boxes_mask, input_boxes_counts, encoder_hidden_states)
real = input_boxes_mask.bool()
diff = (out - out_alt).abs()[real].max().item()
print(f"max |decoder output change at real box positions| when only the PAD boxes change (should be 0): {diff:.6f}")
