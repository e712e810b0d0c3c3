"""LLaDA (masked diffusion LM): the attention call drops the padding mask of a batched input.

Citation: ML-GSAI/LLaDA#89 ("LLaDA-8B Model Ignores Attention Mask in Forward Process") and
ML-GSAI/LLaDA#90 (quotes the line `attn_mask=None, ... is_causal=False` in
LLaDABlock.attention of the released modeling_llada.py).  Fixed downstream in
ZHZisZZ/dllm#3 ("Add in attention_mask support for llada/lladamoe"; the dllm copy of
modeling_llada.py passes `attn_mask=attention_bias`) and proposed upstream as the Hugging Face
discussion PR GSAI-ML/LLaDA-8B-Instruct/discussions/13 (which I could not open from here).

Bug: LLaDA is bidirectional (no causal mask, "Modify: MDM set causal to False, and with no
attn_mask").  LLaDAModel.forward accepts `attention_mask` (batch, seq) as in transformers and
turns it into an additive (batch, 1, 1, seq) bias, but LLaDABlock.attention called
`_scaled_dot_product_attention(q, k, v, attn_mask=None, ...)`, so every token of a padded
batch also attended to the pad tokens (#89: logits identical with and without the mask).
Fix: pass the sliced, cast `attention_bias` as `attn_mask`.

This program keeps the OLMo-derived structure (ModelConfig dataclass, fused att_proj,
RoPE, SwiGLU, LLaDALlamaBlock, attention_mask -> attention_bias in the model forward) at toy
size with random weights, and runs one denoising step of batched generation: two prompts
left-padded with the EOS/pad id 126081 to a common length, followed by `gen_length`
positions of the mask id 126336, with the tokenizer's attention_mask.
"""
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelConfig:
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    n_layers: int = 2
    mlp_hidden_size: int = 128
    rope: bool = True
    rope_theta: float = 500000.0
    vocab_size: int = 126464
    embedding_size: int = 126464
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    include_bias: bool = False
    attention_dropout: float = 0.0
    max_sequence_length: int = 4096

    @property
    def effective_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


class RMSLayerNorm(nn.Module):
    def __init__(self, config: ModelConfig, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(config.d_model))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        dim = config.d_model // config.n_heads
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def rotate_half(self, x):
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return (t * pos_cos) + (self.rotate_half(t) * pos_sin)

    def forward(self, q, k):
        query_len, key_len = q.shape[-2], k.shape[-2]
        seq = torch.arange(key_len, dtype=torch.float)
        freqs = torch.einsum("i , j -> i j", seq, self.inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        pos_sin, pos_cos = positions.sin()[None, None], positions.cos()[None, None]
        q_ = self.apply_rotary_pos_emb(pos_sin[:, :, key_len - query_len:key_len, :],
                                       pos_cos[:, :, key_len - query_len:key_len, :], q)
        k_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, k)
        return q_.type_as(q), k_.type_as(k)


class LLaDALlamaBlock(nn.Module):
    def __init__(self, layer_id: int, config: ModelConfig):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        head_dim = config.d_model // config.n_heads
        self.attn_norm = RMSLayerNorm(config)
        self.ff_norm = RMSLayerNorm(config)
        self.rotary_emb = RotaryEmbedding(config)
        self.q_norm = self.k_norm = None
        self.fused_dims = (config.d_model, config.effective_n_kv_heads * head_dim,
                           config.effective_n_kv_heads * head_dim)
        self.att_proj = nn.Linear(config.d_model, sum(self.fused_dims), bias=config.include_bias)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=config.include_bias)
        self.ff_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=config.include_bias)
        self.ff_out = nn.Linear(config.mlp_hidden_size // 2, config.d_model, bias=config.include_bias)

    def act(self, x):
        # SwiGLU
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x

    @staticmethod
    def _cast_attn_bias(bias: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        if bias.dtype != input_dtype:
            bias = bias.to(input_dtype)
        return bias

    def _scaled_dot_product_attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        # Modify: MDM set causal to False, and with no attn_mask.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=False)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_bias: Optional[torch.Tensor] = None,
        layer_past: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        use_cache: bool = False,
    ):
        B, T, C = q.size()
        dtype = k.dtype
        q = q.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        k = k.view(B, T, self.config.effective_n_kv_heads, C // self.config.n_heads).transpose(1, 2)
        v = v.view(B, T, self.config.effective_n_kv_heads, C // self.config.n_heads).transpose(1, 2)

        if layer_past is not None:
            past_key, past_value = layer_past
            k = torch.cat((past_key, k), dim=-2)
            v = torch.cat((past_value, v), dim=-2)

        present = (k, v) if use_cache else None
        query_len, key_len = q.shape[-2], k.shape[-2]

        if self.config.rope:
            q, k = self.rotary_emb(q, k)

        if attention_bias is not None:
            attention_bias = self._cast_attn_bias(
                attention_bias[:, :, key_len - query_len: key_len, :key_len], dtype
            )

        # Get the attention scores.
        # shape: (B, nh, T, hs)
        att = self._scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_bias if FIXED else None,
            dropout_p=0.0 if not self.training else self.config.attention_dropout,
            is_causal=False,
        )

        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att), present

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False):
        q, k, v = self.att_proj(self.attn_norm(x)).split(self.fused_dims, dim=-1)
        att, cache = self.attention(q, k, v, attention_bias, layer_past=layer_past, use_cache=use_cache)
        x = x + att
        og_x = x
        x = self.ff_out(self.act(self.ff_proj(self.ff_norm(x))))
        return og_x + x, cache


class LLaDAModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.embedding_size, config.d_model)
        self.blocks = nn.ModuleList([LLaDALlamaBlock(i, config) for i in range(config.n_layers)])
        self.ln_f = RMSLayerNorm(config)
        self.ff_out = nn.Linear(config.d_model, config.embedding_size, bias=config.include_bias)

    def forward(self, input_ids, attention_mask: Optional[torch.Tensor] = None):
        batch_size, seq_len = input_ids.size()
        x = self.wte(input_ids)

        # Transform the attention mask into what the blocks expect.
        if attention_mask is not None and 0.0 in attention_mask:
            # shape: (batch_size, 1, 1, seq_len)
            attention_mask = attention_mask.to(dtype=torch.float).view(batch_size, -1)[:, None, None, :]
            attention_mask = (1.0 - attention_mask) * torch.finfo(attention_mask.dtype).min
        else:
            attention_mask = None

        if attention_mask is not None:
            attention_bias = attention_mask.to(dtype=torch.float)
        else:
            attention_bias = None

        for block in self.blocks:
            x, _ = block(x, attention_bias=attention_bias)
        x = self.ln_f(x)
        return self.ff_out(x)


def main():
    torch.manual_seed(0)
    config = ModelConfig()
    model = LLaDAModel(config).eval()

    gen_length = 4
    prompts = [[101, 2040, 2003], [101, 7592, 1010, 2129, 2024, 2017]]
    max_prompt = max(len(p) for p in prompts)
    # left padding with the tokenizer's pad (== eos) id, as for batched generation
    input_ids = torch.tensor([[config.pad_token_id] * (max_prompt - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (max_prompt - len(p)) + [1] * len(p) for p in prompts])

    x = torch.cat([input_ids, torch.full((len(prompts), gen_length), config.mask_token_id)], dim=1)
    attention_mask = torch.cat([attention_mask, torch.ones(len(prompts), gen_length, dtype=torch.long)], dim=1)

    with torch.no_grad():
        logits = model(x, attention_mask=attention_mask)
    mask_index = x == config.mask_token_id
    x0 = torch.argmax(logits, dim=-1)
    x = torch.where(mask_index, x0, x)
    print("fixed" if FIXED else "buggy", x[:, max_prompt:].tolist(), f"{logits[0, -1].abs().sum().item():.3f}")


if __name__ == "__main__":
    main()
