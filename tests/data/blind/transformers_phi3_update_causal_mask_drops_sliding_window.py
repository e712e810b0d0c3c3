# huggingface/transformers#33586 (fixes #32945): after the cache refactor Phi3's `_update_causal_mask` built a plain
# causal 4D mask and ignored `config.sliding_window`, so sdpa/eager prompts longer than the window attended to everything.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Phi3Config:
    vocab_size = 64
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    sliding_window = 4
    rope_theta = 10000.0


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Phi3RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


class Phi3SdpaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.rotary_emb = Phi3RotaryEmbedding(self.head_dim, config.rope_theta)
        self.is_causal = True

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        cos, sin = self.rotary_emb(position_ids)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        causal_mask = attention_mask
        is_causal = causal_mask is None and q_len > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask, is_causal=is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attn = Phi3SdpaAttention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.SiLU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, x, attention_mask, position_ids):
        x = x + self.self_attn(self.input_layernorm(x), attention_mask, position_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Phi3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Phi3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position):
        dtype, device = input_tensor.dtype, input_tensor.device
        min_dtype = torch.finfo(dtype).min
        batch_size, sequence_length = input_tensor.shape[:2]
        target_length = attention_mask.shape[-1]
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype, device=device)
        exclude_mask = torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
        if FIXED and self.config.sliding_window is not None:
            exclude_mask.bitwise_or_(
                torch.arange(target_length, device=device) <= (cache_position.reshape(-1, 1) - self.config.sliding_window)
            )
        causal_mask *= exclude_mask
        causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
        causal_mask = causal_mask.clone()
        padding_mask = causal_mask[:, :, :, :target_length] + attention_mask[:, None, None, :]
        padding_mask = padding_mask == 0
        causal_mask[:, :, :, :target_length] = causal_mask[:, :, :, :target_length].masked_fill(padding_mask, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask):
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = torch.arange(input_ids.shape[1])
        position_ids = cache_position.unsqueeze(0)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask, position_ids)
        return self.norm(hidden_states)


config = Phi3Config()
model = Phi3Model(config).eval()
input_ids = torch.randint(0, config.vocab_size, (2, 12))
attention_mask = torch.ones_like(input_ids)
with torch.no_grad():
    out = model(input_ids, attention_mask)
    # reference: the last token only depends on the last `sliding_window` tokens per layer, so the
    # first tokens are too far back (2 layers x 3 steps) to influence it
    changed = input_ids.clone()
    changed[:, :3] = (changed[:, :3] + 1) % config.vocab_size
    out2 = model(changed, attention_mask)
print(f"sliding_window={config.sliding_window} fixed={FIXED} "
      f"last-token change when far-away tokens change: {(out[:, -1] - out2[:, -1]).abs().max().item():.4f}")
