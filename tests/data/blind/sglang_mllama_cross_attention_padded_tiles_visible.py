# sgl-project/sglang#40476: Mllama text cross-attention ran over every one of max_num_tiles tile slots of an
# image, so text tokens attended to the processor's zero-padding tiles; the fix masks keys to the valid tiles.
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

    def forward(self, positions, hidden_states, encoder_states_list, num_tiles_list, encoder_lens):
        # hidden_states: flattened text tokens of all requests in the batch (token-packed, as in the server)
        outputs = []
        start = 0
        for req, (enc_len, enc_states) in enumerate(zip(encoder_lens, encoder_states_list)):
            seq_len = int(positions[req])
            h = hidden_states[start:start + seq_len]
            # cross_attention_states: every tile slot of the image, padded to max_num_tiles by the processor
            cross_states = enc_states.reshape(-1, self.config.hidden_size)[:enc_len]
            mask = None
            if FIXED:
                valid = torch.zeros(self.config.max_num_tiles, self.config.num_patches_per_tile, dtype=torch.bool)
                valid[: num_tiles_list[req]] = True
                mask = valid.flatten()[:enc_len][None, None, :].expand(1, seq_len, enc_len)
            attn = self.cross_attn(h, cross_states, attention_mask=mask)
            outputs.append(h + self.cross_attn_attn_gate.tanh() * attn)
            start += seq_len
        return torch.cat(outputs)


config = MllamaConfig()
model = MllamaForConditionalGeneration(config).eval()

# two requests; request 0 has an image split into 2 tiles, request 1 an image of 4 tiles
num_tiles_list = [2, 4]
encoder_states_list = []
for n in num_tiles_list:
    tiles = torch.randn(config.max_num_tiles, config.num_patches_per_tile, config.hidden_size)
    # padded tile slots are zero pixels; after the vision tower they are not zero features
    tiles[n:] = torch.randn(config.max_num_tiles - n, config.num_patches_per_tile, config.hidden_size) * 0.5 + 1.0
    encoder_states_list.append(tiles)
encoder_lens = [config.max_num_tiles * config.num_patches_per_tile] * 2
positions = torch.tensor([6, 5])
hidden_states = torch.randn(int(positions.sum()), config.hidden_size)

with torch.no_grad():
    out = model(positions, hidden_states, encoder_states_list, num_tiles_list, encoder_lens)
    # reference: request 0 alone with only its two real tiles in cross_attention_states
    ref_model_states = [encoder_states_list[0][:2]]
    ref = model(positions[:1], hidden_states[:6], ref_model_states, [2],
                [2 * config.num_patches_per_tile])

print("mode:", "fixed" if FIXED else "buggy")
print("max |out - out(real tiles only)| for request 0: %.4f" % (out[:6] - ref).abs().max())
