"""OLMo (v1) model: the causal bias and the padding mask are turned into ONE additive float bias in
OLMo.forward, -inf clamped back to finfo.min by ensure_finite_, then passed down to every block by
keyword; each block slices the rows of its queries out of it.  Used here for left-padded batched greedy
generation with a KV cache over several decode steps.

Follows allenai/OLMo olmo/model.py: get_causal_attention_bias (triu of finfo.min), OLMo.forward
(`attention_mask = (1.0 - attention_mask) * finfo.min`, `attention_bias[:, :, :mask_len, :mask_len] +
attention_mask`, `ensure_finite_(attention_bias, check_neg_inf=True)`), OLMoBlock.attention
(`attention_bias[:, :, key_len - query_len : key_len, :key_len]`), RotaryEmbedding (positions
`key_len - query_len : key_len`, i.e. counted over the cache including left padding; RoPE is relative
so a per-row shift does not change scores).

Mask meant: causal over the whole cache, minus each row's left-padding keys.  The rows of padded
queries see only padding (all finfo.min, finite, uniform); their outputs are never read.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    vocab_size: int = 50
    max_sequence_length: int = 64
    rope_theta: float = 10000.0


def get_causal_attention_bias(seq_len: int, device) -> torch.Tensor:
    att_bias = torch.triu(torch.ones(seq_len, seq_len, device=device, dtype=torch.float), diagonal=1)
    att_bias.masked_fill_(att_bias == 1, torch.finfo(att_bias.dtype).min)
    return att_bias.view(1, 1, seq_len, seq_len)


def ensure_finite_(x: torch.Tensor, check_neg_inf: bool = True, check_pos_inf: bool = False):
    if check_neg_inf:
        x.masked_fill_(x == float("-inf"), torch.finfo(x.dtype).min)
    if check_pos_inf:
        x.masked_fill_(x == float("inf"), torch.finfo(x.dtype).max)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        dim = config.d_model // config.n_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        seq = torch.arange(config.max_sequence_length, dtype=torch.float)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("pos_sin", positions.sin()[None, None], persistent=False)
        self.register_buffer("pos_cos", positions.cos()[None, None], persistent=False)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q, k):
        query_len, key_len = q.shape[-2], k.shape[-2]
        sin_q = self.pos_sin[:, :, key_len - query_len:key_len]
        cos_q = self.pos_cos[:, :, key_len - query_len:key_len]
        q_ = q * cos_q + self.rotate_half(q) * sin_q
        k_ = k * self.pos_cos[:, :, :key_len] + self.rotate_half(k) * self.pos_sin[:, :, :key_len]
        return q_, k_


class OLMoSequentialBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.attn_norm = nn.LayerNorm(config.d_model, elementwise_affine=False)
        self.ff_norm = nn.LayerNorm(config.d_model, elementwise_affine=False)
        self.att_proj = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.ff = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(), nn.Linear(4 * config.d_model, config.d_model))
        self.rotary_emb = RotaryEmbedding(config)

    def attention(self, q, k, v, attention_bias=None, layer_past=None, use_cache=False):
        B, T, C = q.size()
        nh = self.config.n_heads
        q = q.view(B, T, nh, C // nh).transpose(1, 2)
        k = k.view(B, T, nh, C // nh).transpose(1, 2)
        v = v.view(B, T, nh, C // nh).transpose(1, 2)
        if layer_past is not None:
            past_key, past_value = layer_past
            k = torch.cat((past_key, k), dim=-2)
            v = torch.cat((past_value, v), dim=-2)
        present = (k, v) if use_cache else None
        query_len, key_len = q.shape[-2], k.shape[-2]
        q, k = self.rotary_emb(q, k)
        if attention_bias is not None:
            attention_bias = attention_bias[:, :, key_len - query_len:key_len, :key_len].to(q.dtype)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias, dropout_p=0.0,
                                             is_causal=attention_bias is None)
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att), present

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False):
        q, k, v = self.att_proj(self.attn_norm(x)).split(self.config.d_model, dim=-1)
        att, cache = self.attention(q, k, v, attention_bias, layer_past=layer_past, use_cache=use_cache)
        x = x + att
        return x + self.ff(self.ff_norm(x)), cache


class OLMo(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(OLMoSequentialBlock(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None, use_cache: bool = False):
        batch_size, seq_len = input_ids.size()
        past_length = 0 if past_key_values is None else past_key_values[0][0].size(-2)
        x = self.wte(input_ids)
        attention_bias = None
        if attention_mask is not None:
            attention_mask = attention_mask.to(dtype=torch.float).view(batch_size, -1)[:, None, None, :]
            attention_mask = (1.0 - attention_mask) * torch.finfo(attention_mask.dtype).min
        if attention_mask is not None or past_key_values is not None:
            attention_bias = get_causal_attention_bias(past_length + seq_len, x.device)
            mask_len = seq_len
            if attention_mask is not None:
                mask_len = attention_mask.shape[-1]
            elif past_key_values is not None:
                mask_len = past_key_values[0][0].shape[-2] + seq_len
            attention_bias = attention_bias[:, :, :mask_len, :mask_len].to(dtype=torch.float)
            if attention_mask is not None:
                attention_bias = attention_bias + attention_mask
                # finfo.min + finfo.min overflows to -inf, which SDPA turns into NaN on all-masked rows
                ensure_finite_(attention_bias, check_neg_inf=True, check_pos_inf=False)
        attn_key_values = [] if use_cache else None
        for block_idx, block in enumerate(self.blocks):
            layer_past = None if past_key_values is None else past_key_values[block_idx]
            x, cache = block(x, attention_bias=attention_bias, layer_past=layer_past, use_cache=use_cache)
            if attn_key_values is not None:
                attn_key_values.append(cache)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight, None)  # weight tying
        return logits, attn_key_values


@torch.no_grad()
def greedy_generate(model, input_ids, attention_mask, max_steps):
    logits, past = model(input_ids, attention_mask=attention_mask, use_cache=True)
    out = []
    for _ in range(max_steps):
        next_tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(next_tok)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=-1)
        logits, past = model(next_tok, attention_mask=attention_mask, past_key_values=past, use_cache=True)
    return torch.cat(out, dim=-1)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = OLMo(ModelConfig()).eval()
    pad = 0
    prompts = [[7, 3, 9, 12, 4, 5, 8], [11]]  # full row and a row that is all padding but one token
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batched = greedy_generate(model, input_ids, attention_mask, max_steps=4)
    for i, p in enumerate(prompts):
        single = greedy_generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), max_steps=4)
        assert torch.equal(single[0], batched[i]), (single, batched[i])
    print("generated", batched.tolist())
