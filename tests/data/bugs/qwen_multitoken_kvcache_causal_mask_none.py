"""Qwen (modeling_qwen.py): no causal mask when several new tokens are fed on top of a KV cache.

Citation: QwenLM/Qwen issue #979 ("Qwen最新版本存在causal_mask bug，导致在有kv_cache的情况下，多个tokens的
输入会得到不同的结果"), which traces it to the Hugging Face Hub commit 2abd8e5777bb4ce9c8ab4be7dbbd0fe4526db78d
of Qwen/Qwen-7B-Chat `modeling_qwen.py`. The buggy `QWenAttention.forward` lines were read in a stored
copy of `modeling_qwen.py`; the fix is the one the issue describes (change the condition and slice the
causal mask), because the Hub file history could not be read here.

Bug: `if query.size(1) == key_size: causal_mask = tril(ones(key_size, key_size)) else: causal_mask = None`.
With a cache and more than one new token (query 4, key 10) the mask is None; the padding mask from
`QWenModel.forward` (all zeros for an unpadded batch) is used alone, so the new tokens attend each other's
future positions, and the result differs from feeding them one by one.

Fix: always build the causal mask and keep its last `query.size(1)` rows:
`tril(ones(key_size, key_size))[:, :, key_size - query.size(1):key_size, :key_size]`.

Reproduction: a 2-layer QWen-style model (`c_attn`, rotary, `layer_past` tuples in (B, T, H, D)), SDPA
path (`SUPPORT_TORCH2`); prefill 6 tokens, then feed a 4-token chunk with the cache, as in the issue.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
SUPPORT_TORCH2 = True


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    cos, sin = freqs
    return t * cos + rotate_half(t) * sin


class QWenAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.c_attn = nn.Linear(config.hidden_size, 3 * self.projection_size)
        self.c_proj = nn.Linear(config.hidden_size, self.projection_size, bias=not config.no_bias)
        self.use_cache_quantization = False

    def forward(self, hidden_states, rotary_pos_emb, layer_past=None, attention_mask=None, use_cache=False):
        mixed_x_layer = self.c_attn(hidden_states)
        query, key, value = mixed_x_layer.split(self.projection_size, dim=2)
        B, T, _ = query.shape
        query = query.view(B, T, self.num_heads, self.head_dim)
        key = key.view(B, T, self.num_heads, self.head_dim)
        value = value.view(B, T, self.num_heads, self.head_dim)
        query = apply_rotary_pos_emb(query, rotary_pos_emb)
        key = apply_rotary_pos_emb(key, rotary_pos_emb)
        if layer_past is not None:
            past_key, past_value = layer_past[0], layer_past[1]
            key = torch.cat((past_key, key), dim=1)
            value = torch.cat((past_value, value), dim=1)
        present = (key, value) if use_cache else None

        key_size = key.size(1)
        if FIXED:
            causal_mask = torch.tril(
                torch.ones((key_size, key_size), dtype=torch.bool, device=query.device)
            ).view(1, 1, key_size, key_size)[:, :, key_size - query.size(1):key_size, :key_size]
        elif query.size(1) == key_size:
            causal_mask = torch.tril(
                torch.ones((key_size, key_size), dtype=torch.bool, device=query.device)
            ).view(1, 1, key_size, key_size)
        else:
            causal_mask = None
        query = query.permute(0, 2, 1, 3)
        key = key.permute(0, 2, 1, 3)
        value = value.permute(0, 2, 1, 3)
        if attention_mask is not None:
            attention_mask = attention_mask.expand(-1, -1, query.size(2), -1)
            if causal_mask is not None:
                attention_mask = attention_mask.masked_fill(~causal_mask, torch.finfo(query.dtype).min)
        else:
            attention_mask = causal_mask
        attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask).transpose(1, 2)
        return self.c_proj(attn_output.reshape(B, T, -1)), present


class QWenModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList([QWenAttention(config) for _ in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        dim = config.kv_channels
        self.inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True):
        past_length = 0 if past_key_values is None else past_key_values[0][0].size(-3)
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.h))
        if attention_mask is not None:
            attention_mask = attention_mask.view(input_ids.shape[0], -1)[:, None, None, :]
            attention_mask = (1.0 - attention_mask.float()) * torch.finfo(torch.float32).min
        kv_seq_len = past_length + input_ids.shape[1]
        freqs = torch.outer(torch.arange(kv_seq_len).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None, past_length:, None, :]
        rotary_pos_emb = (emb.cos(), emb.sin())
        hidden_states = self.wte(input_ids)
        presents = ()
        for block, layer_past in zip(self.h, past_key_values):
            out, present = block(F.rms_norm(hidden_states, (hidden_states.shape[-1],)), rotary_pos_emb,
                                 layer_past=layer_past, attention_mask=attention_mask, use_cache=use_cache)
            hidden_states = hidden_states + out
            presents = presents + (present,)
        return self.lm_head(hidden_states), presents


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=64, hidden_size=32, num_attention_heads=4, kv_channels=8,
                             num_hidden_layers=2, no_bias=True)
    model = QWenModel(config).eval()
    ids = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        _, past = model(ids[:, :6], attention_mask=torch.ones(1, 6))
        logits, _ = model(ids[:, 6:], past_key_values=past, attention_mask=torch.ones(1, 10))
    print("next tokens for the 4-token chunk:", logits[0].argmax(-1).tolist())


if __name__ == "__main__":
    main()
