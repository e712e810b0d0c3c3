"""T5Gemma2-style encoder whose self-attention module is flagged causal.

Citation: huggingface/transformers#42820 ("[T5Gemma2] Fix bidirectional mask for encoder",
merged 2025-12-12). I read the PR description, not its diff: "Wrong `is_causal` flag causes
unexpected behavior where when we shortcut mask creation (all True) we trigger SDPA's
`is_causal=True` behavior."

Bug: the encoder's self-attention module carried `is_causal = True`. The bidirectional mask
builder skips materialising a mask when the padding mask is all ones (returns None), and the
SDPA integration then computes `is_causal = q_length > 1 and attention_mask is None and
module.is_causal`, so an unpadded encoder batch ran *causal* attention on its full-attention
layers, while a padded batch (mask materialised) ran bidirectional attention.

Fix: the encoder self-attention sets `self.is_causal = False` ("Only used by the encoder").

Reproduction: plain torch, written after transformers' T5Gemma2 encoder: a text config with
`layer_types` mixing sliding and full attention, `create_bidirectional_mask` with the all-ones
shortcut, and an `sdpa_attention_forward` that reads the module's `is_causal`. The batch has no
padding, so the full-attention layer gets attention_mask=None. Run with --fixed for the fix.
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class T5Gemma2TextConfig:
    vocab_size: int = 100
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    query_pre_attn_scalar: int = 8
    sliding_window: int = 4
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    _attn_implementation: str = "sdpa"


def sliding_window_mask_function(sliding_window, is_causal=True):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        left = q_idx - kv_idx < sliding_window
        if is_causal:
            return left
        return left & (kv_idx - q_idx < sliding_window)
    return inner_mask


def create_bidirectional_mask(config, inputs_embeds, attention_mask, and_mask_function=None):
    """Boolean (batch, 1, q, kv) mask, or None when every position may attend everywhere."""
    batch, length = inputs_embeds.shape[:2]
    if attention_mask is None:
        attention_mask = torch.ones(batch, length, dtype=torch.bool)
    # Shortcut used by SDPA: an all-True padding mask and no extra pattern needs no tensor.
    if and_mask_function is None and bool(attention_mask.all()):
        return None
    idx = torch.arange(length)
    mask = attention_mask.bool()[:, None, None, :].expand(batch, 1, length, length)
    if and_mask_function is not None:
        mask = mask & and_mask_function(None, None, idx[:, None], idx[None, :])
    return mask


def repeat_kv(hidden_states, n_rep):
    b, h, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling=None, is_causal=None):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         is_causal=is_causal, scale=scaling)
    return out.transpose(1, 2).contiguous()


class T5Gemma2SelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar ** -0.5
        if FIXED:
            self.is_causal = False  # Only used by the encoder
        else:
            self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    def forward(self, hidden_states, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        out = sdpa_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)
        return self.o_proj(out.reshape(*input_shape, -1))


class T5Gemma2EncoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = T5Gemma2SelfAttention(config, layer_idx)
        self.pre_self_attn_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(approximate="tanh"),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.pre_feedforward_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attn(self.pre_self_attn_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.pre_feedforward_layernorm(hidden_states))


class T5Gemma2TextEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([T5Gemma2EncoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, attention_mask=None):
        inputs_embeds = self.embed_tokens(input_ids)
        mask_kwargs = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask}
        self_attn_mask_mapping = {
            "full_attention": create_bidirectional_mask(**mask_kwargs),
            "sliding_attention": create_bidirectional_mask(
                **mask_kwargs,
                and_mask_function=sliding_window_mask_function(self.config.sliding_window, is_causal=False),
            ),
        }
        hidden_states = inputs_embeds
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, self_attn_mask_mapping[self.config.layer_types[i]])
        return self.norm(hidden_states)


def main():
    torch.manual_seed(0)
    config = T5Gemma2TextConfig()
    encoder = T5Gemma2TextEncoder(config).eval()
    input_ids = torch.randint(1, config.vocab_size, (2, 10))
    attention_mask = torch.ones(2, 10, dtype=torch.long)  # no padding in this batch
    with torch.no_grad():
        out = encoder(input_ids, attention_mask=attention_mask)
    print("encoder states", tuple(out.shape), "checksum %.4f" % out.sum().item())


if __name__ == "__main__":
    main()
