# adapter-hub/adapters#722 (closes #721): LlamaSdpaAttentionWithAdapters called F.scaled_dot_product_attention
# without is_causal; when Llama's _update_causal_mask returns None (no padding) the LoRA-Llama attends to the future.
import math
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LoRALinear(nn.Module):
    """adapters LoRA on q_proj / v_proj (W x + B A x * scaling)."""

    def __init__(self, i, o, r=4, alpha=8):
        super().__init__()
        self.base = nn.Linear(i, o, bias=False)
        self.lora_A = nn.Parameter(torch.randn(r, i) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(o, r) * 0.1)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class LlamaSdpaAttentionWithAdapters(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, hidden_size // num_heads
        self.num_key_value_heads = num_heads
        self.q_proj = LoRALinear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = LoRALinear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim)
        self.attention_dropout = 0.0

    def prefix_tuning(self, key_states, value_states, hidden_states, attention_mask):
        return key_states, value_states, attention_mask  # no prefix-tuning adapter active

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states, value_states, attention_mask = self.prefix_tuning(
            key_states, value_states, hidden_states, attention_mask
        )
        bsz = key_states.shape[0]

        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = causal_mask[:, :, :, : key_states.shape[-2]]

        if FIXED:
            is_causal = True if causal_mask is None and q_len > 1 else False
            attn_output = F.scaled_dot_product_attention(
                query_states, key_states, value_states, attn_mask=causal_mask,
                dropout_p=self.attention_dropout if self.training else 0.0, is_causal=is_causal,
            )
        else:
            attn_output = F.scaled_dot_product_attention(
                query_states, key_states, value_states, attn_mask=causal_mask,
                dropout_p=self.attention_dropout if self.training else 0.0,
            )
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


def _update_causal_mask(attention_mask, input_tensor, cache_position):
    """transformers 4.42 LlamaModel._update_causal_mask for sdpa: rely on is_causal when there is no padding."""
    dtype = input_tensor.dtype
    sequence_length = input_tensor.shape[1]
    if attention_mask is None or bool(attention_mask.all()):  # AttentionMaskConverter._ignore_causal_mask_sdpa
        return None
    min_dtype = torch.finfo(dtype).min
    target_length = attention_mask.shape[-1]
    causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
    causal_mask = torch.triu(causal_mask, diagonal=1)
    causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
    causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1).clone()
    padding_mask = causal_mask[:, :, :, :target_length] + attention_mask[:, None, None, :]
    causal_mask[:, :, :, :target_length] = causal_mask[:, :, :, :target_length].masked_fill(padding_mask == 0, min_dtype)
    return causal_mask


class TinyLlamaWithLoRA(nn.Module):
    def __init__(self, vocab=64, hidden=32, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaSdpaAttentionWithAdapters(hidden) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed_tokens(input_ids)
        cache_position = torch.arange(h.shape[1])
        position_ids = cache_position[None].expand(h.shape[0], -1)
        causal_mask = _update_causal_mask(attention_mask, h, cache_position)
        for layer in self.layers:
            h = h + layer(h, attention_mask=causal_mask, position_ids=position_ids)
        return self.lm_head(h)


model = TinyLlamaWithLoRA().eval()
input_ids = torch.randint(0, 64, (2, 12))
attention_mask = torch.ones(2, 12, dtype=torch.long)  # training batch without padding
with torch.no_grad():
    full = model(input_ids, attention_mask)
    # reference: causal LM => logits at position t must not depend on tokens after t
    ref = torch.stack([model(input_ids[:, : t + 1], attention_mask[:, : t + 1])[:, -1] for t in range(12)], 1)
print("max |logits(full seq) - logits(prefix only)|:", f"{(full - ref).abs().max().item():.6f}")
