# Megatron-Bridge, models/qwen_vl/modelling_qwen3_vl/model.py Qwen3VLModel.forward (NVIDIA-NeMo/Megatron-Bridge#2582).
# The BSHD path passed Megatron's 4D attention mask ([B,1,S,S] bool, True = masked) to get_rope_index, which expects an
# HF keep-mask [B,S]; its .any(-1) collapse marks the last real token of an unpadded row as padding -> wrong MRoPE ids.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, VSTART, IMG, VID = 0, 1, 2, 3
SPATIAL_MERGE = 2
D, H, L, V = 48, 4, 2, 40
HD = D // H
MROPE_SECTION = [2, 2, 2]   # head_dim // 2 == 6


def get_rope_index(spatial_merge_size, image_token_id, video_token_id, vision_start_token_id, input_ids=None,
                   image_grid_thw=None, video_grid_thw=None, attention_mask=None, packed_seq_params=None):
    mrope_position_deltas = []
    if input_ids is not None and (image_grid_thw is not None or video_grid_thw is not None):
        total_input_ids = input_ids
        if attention_mask is None:
            attention_mask = torch.ones_like(total_input_ids)
        # Handle multi-dimensional attention masks
        elif attention_mask.dim() > 2:
            # Collapse to [batch, seq] while preserving padding information
            attention_mask = attention_mask.any(dim=-1)
            if attention_mask.dim() == 3:
                attention_mask = attention_mask.squeeze(1)
            attention_mask = attention_mask.to(dtype=total_input_ids.dtype)
        position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=input_ids.dtype)
        image_index, video_index = 0, 0
        for i, sample_input_ids in enumerate(total_input_ids):
            sample_input_ids = sample_input_ids[attention_mask[i] == 1]
            vision_start_indices = torch.argwhere(sample_input_ids == vision_start_token_id).squeeze(1)
            vision_tokens = sample_input_ids[vision_start_indices + 1]
            image_nums = (vision_tokens == image_token_id).sum()
            input_tokens = sample_input_ids.tolist()
            llm_pos_ids_list = []
            st = 0
            for _ in range(image_nums):
                ed = input_tokens.index(image_token_id, st)
                t, h, w = image_grid_thw[image_index]
                image_index += 1
                llm_grid_t, llm_grid_h, llm_grid_w = t.item(), h.item() // spatial_merge_size, w.item() // spatial_merge_size
                text_len = ed - st
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
                t_index = torch.arange(llm_grid_t).view(-1, 1).expand(-1, llm_grid_h * llm_grid_w).flatten()
                h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
                w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
                llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
                st = ed + llm_grid_t * llm_grid_h * llm_grid_w
            if st < len(input_tokens):
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                text_len = len(input_tokens) - st
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
            llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
            position_ids[..., i, attention_mask[i] == 1] = llm_positions
            mrope_position_deltas.append(llm_positions.max() + 1 - len(total_input_ids[i]))
        return position_ids, torch.tensor(mrope_position_deltas).unsqueeze(1)
    raise NotImplementedError


class Qwen3VLMultimodalRotaryEmbedding(nn.Module):
    def __init__(self, kv_channels, rotary_base=10000):
        super().__init__()
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, kv_channels, 2, dtype=torch.float32) / kv_channels))

    def apply_interleaved_mrope(self, freqs, mrope_section):
        freqs_t = freqs[0]
        for dim, offset in enumerate((1, 2), start=1):
            length = mrope_section[dim] * 3
            idx = slice(offset, length, 3)
            freqs_t[..., idx] = freqs[dim, ..., idx]
        return freqs_t

    def forward(self, position_ids, mrope_section):
        seq = position_ids.to(dtype=torch.float32)
        inv_freq_expanded = self.inv_freq[None, None, :, None].expand(3, seq.shape[1], -1, 1)
        freqs = (inv_freq_expanded @ seq[:, :, None, :].float()).transpose(2, 3)
        freqs = self.apply_interleaved_mrope(freqs, mrope_section)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[..., None, :].transpose(0, 1).contiguous()   # [s, b, 1, hd]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, rotary_pos_emb, attention_mask):
        # x: [s, b, h]; attention_mask: Megatron bool [b|1, 1, s, s], True = masked
        s, b, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, H, HD).permute(2, 1, 3, 0, 4)
        emb = rotary_pos_emb.permute(1, 2, 0, 3)                 # [b, 1, s, hd]
        q = q * emb.cos() + rotate_half(q) * emb.sin()
        k = k * emb.cos() + rotate_half(k) * emb.sin()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask)
        x = x + self.proj(o.permute(2, 0, 1, 3).reshape(s, b, D))
        return x + self.mlp(self.ln2(x))


class Qwen3VLModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rotary_pos_emb = Qwen3VLMultimodalRotaryEmbedding(HD)
        self.layers = nn.ModuleList([Block() for _ in range(L)])
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, attention_mask, vision_embeds, image_grid_thw, position_ids=None):
        x = self.emb(input_ids).masked_scatter((input_ids == IMG)[..., None], vision_embeds).transpose(0, 1)
        if position_ids is None:
            # BSHD
            hf_attention_mask = None if FIXED else attention_mask
            position_ids, _ = get_rope_index(SPATIAL_MERGE, IMG, VID, VSTART, input_ids,
                                             image_grid_thw=image_grid_thw, video_grid_thw=None,
                                             attention_mask=hf_attention_mask)
        self.last_position_ids = position_ids
        rotary_pos_emb = self.rotary_pos_emb(position_ids, MROPE_SECTION)
        for blk in self.layers:
            x = blk(x, rotary_pos_emb, attention_mask)
        return self.head(x.transpose(0, 1))


def megatron_mask(valid):
    # [b, 1, s, s] bool, True = masked: causal plus padded keys
    b, s = valid.shape
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    return (causal[None] | ~valid[:, None, :]).unsqueeze(1)


model = Qwen3VLModel()
grid = torch.tensor([[1, 4, 4], [1, 4, 4]])


def sample(n_pre, n_post):
    return [5 + int(t) for t in torch.randint(0, V - 5, (n_pre,))] + [VSTART] + [IMG] * 4 + \
           [5 + int(t) for t in torch.randint(0, V - 5, (n_post,))]


seqs = [sample(4, 9), sample(3, 3)]           # row 0 fills the batch, row 1 is right-padded
S = max(len(s) for s in seqs)
tokens = torch.full((2, S), PAD)
for i, s in enumerate(seqs):
    tokens[i, :len(s)] = torch.tensor(s)
valid = tokens != PAD
vision_embeds = torch.randn(8, D)

with torch.no_grad():
    logits = model(tokens, megatron_mask(valid), vision_embeds, grid)
    print("position_ids[0, 0] =", model.last_position_ids[0, 0].tolist())
    worst = 0.0
    for i, s in enumerate(seqs):
        ids = torch.tensor([s])
        pid, _ = get_rope_index(SPATIAL_MERGE, IMG, VID, VSTART, ids, image_grid_thw=grid[i:i + 1])
        ref = model(ids, megatron_mask(torch.ones_like(ids, dtype=torch.bool)), vision_embeds[4 * i:4 * i + 4],
                    grid[i:i + 1], position_ids=pid)
        worst = max(worst, (logits[i, :len(s)] - ref[0]).abs().max().item())
print(f"max |logits(batch, BSHD) - logits(each sample alone, HF rope ids)| = {worst:.3e}")
