# sgl-project/sglang#40476: Mllama ran text cross-attention with cross_attention_mask = None over all
# max_num_tiles tile slots of an image, so text attended to padded tiles; the fix masks keys to the real tiles.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MllamaConfig:
    hidden_size = 32
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 8
    max_num_tiles = 4
    num_patches_per_tile = 5  # vision tokens per tile (incl. class token)


class MllamaTextCrossAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim)

    def forward(self, hidden_states, cross_attention_states, attention_mask=None):
        q_len, kv_len = hidden_states.shape[0], cross_attention_states.shape[0]
        q = self.q_norm(self.q_proj(hidden_states).view(q_len, self.num_heads, self.head_dim)).transpose(0, 1)
        k = self.k_norm(self.k_proj(cross_attention_states).view(kv_len, self.num_kv, self.head_dim)).transpose(0, 1)
        v = self.v_proj(cross_attention_states).view(kv_len, self.num_kv, self.head_dim).transpose(0, 1)
        groups = self.num_heads // self.num_kv
        k = k.repeat_interleave(groups, dim=0)
        v = v.repeat_interleave(groups, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(0, 1).reshape(q_len, -1))


class MllamaForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.cross_attn = MllamaTextCrossAttention(config)
        self.cross_attn_attn_gate = nn.Parameter(torch.tensor(0.7))

    def flat_encoder_result(self, cross_attention_states, encoder_lens_need):
        out = [cross_attention_states[i][:n] for i, n in enumerate(encoder_lens_need) if n > 0]
        return torch.cat(out)

    def forward(self, hidden_states, seq_lens, cross_attention_states, aspect_ratio_mask, encoder_lens):
        # cross_attention_states: (bs, num_image, max_num_tiles, num_patches, dim), tiles padded by the processor
        bs = cross_attention_states.shape[0]
        cross_attention_states = cross_attention_states.view(bs, -1, self.config.hidden_size)
        cross_attention_states = self.flat_encoder_result(cross_attention_states, encoder_lens)

        cross_attention_mask = None  # TODO: support multi-image by this mask
        if FIXED:
            # aspect_ratio_mask marks the real tiles of each image; keys of padded tiles are masked out
            tile_mask = aspect_ratio_mask.bool().repeat_interleave(self.config.num_patches_per_tile, dim=-1)
            cross_attention_mask = [tile_mask[i].flatten()[:n] for i, n in enumerate(encoder_lens)]

        outputs = []
        q_start = kv_start = 0
        for req, (seq_len, enc_len) in enumerate(zip(seq_lens, encoder_lens)):
            h = hidden_states[q_start:q_start + seq_len]
            kv = cross_attention_states[kv_start:kv_start + enc_len]
            mask = None
            if cross_attention_mask is not None:
                mask = cross_attention_mask[req][None, None, :].expand(1, seq_len, enc_len)
            attn = self.cross_attn(h, kv, attention_mask=mask)
            outputs.append(h + self.cross_attn_attn_gate.tanh() * attn)
            q_start += seq_len
            kv_start += enc_len
        return torch.cat(outputs)


config = MllamaConfig()
model = MllamaForConditionalGeneration(config).eval()

# two requests, one image each; request 0's image was split into 2 tiles, request 1's into 4
num_tiles = [2, 4]
cross_attention_states = torch.randn(2, 1, config.max_num_tiles, config.num_patches_per_tile, config.hidden_size)
aspect_ratio_mask = torch.zeros(2, 1, config.max_num_tiles, dtype=torch.int64)
for i, n in enumerate(num_tiles):
    aspect_ratio_mask[i, 0, :n] = 1
    # padded tile slots hold zero pixels; after the vision tower and projector they are not zero features
    cross_attention_states[i, 0, n:] = cross_attention_states[i, 0, n:] * 0.5 + 1.0
encoder_lens = [1 * config.max_num_tiles * config.num_patches_per_tile] * 2  # num_media * num_tiles * num_patches
seq_lens = [6, 5]
hidden_states = torch.randn(sum(seq_lens), config.hidden_size)

with torch.no_grad():
    out = model(hidden_states, seq_lens, cross_attention_states, aspect_ratio_mask, encoder_lens)
    # reference: request 0 alone, its image given with exactly its 2 real tiles
    ref = model(hidden_states[:6], [6], cross_attention_states[:1, :, :2], aspect_ratio_mask[:1, :, :2],
                [2 * config.num_patches_per_tile])

print("mode:", "fixed" if FIXED else "buggy")
print("max |out - out(real tiles only)| for request 0: %.4f" % (out[:6] - ref).abs().max())
