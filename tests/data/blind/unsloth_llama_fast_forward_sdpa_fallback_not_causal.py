"""unsloth LlamaAttention_fast_forward: the SDPA fallback runs non-causal when the mask was dropped.

Citation: unslothai/unsloth#2868 ("[bugs] fix for casual mask", merged 2025-07).

Bug (from the PR): "In Unsloth, when flash_attn and xformers optimizations are not used, is_causal=False is
always passed into scaled_dot_product_attention even when attention_mask is None ... which leads to bug in
results for finetuning and inference".  ``LlamaModel_fast_forward`` drops the attention mask while training
(``elif self.training: attention_mask = None``), so on a machine without flash-attn / xformers (the PR came
from Intel XPU work) every training step attended bidirectionally: each token saw the tokens it predicts.

Fix: ``is_causal = attention_mask is None and Q_len == K_len`` handed to SDPA.

This program keeps unsloth's structure and names (module flags ``HAS_FLASH_ATTENTION`` / ``HAS_XFORMERS``,
the three attention branches, GQA expand, ``LlamaModel_fast_forward`` dropping the mask in training) on a
tiny random Llama in plain torch.  A training-mode loss on two unpadded 10-token rows: buggy, full
bidirectional attention; fixed, causal.  Only the PR description and the quoted lines were read.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention

FIXED = "--fixed" in sys.argv

HAS_FLASH_ATTENTION = False  # no flash-attn wheel on this device
HAS_XFORMERS = False
xformers = None


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 64


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    forward = None  # patched below, as unsloth patches transformers' class


def LlamaAttention_fast_forward(self, hidden_states, causal_mask=None, attention_mask=None, position_ids=None,
                                past_key_value=None, output_attentions=False, use_cache=False,
                                padding_mask=None, *args, **kwargs):
    bsz, q_len, _ = hidden_states.size()
    n_heads = self.num_heads
    n_groups = self.num_heads // self.num_key_value_heads
    n_kv_heads = self.num_key_value_heads
    head_dim = self.head_dim
    Q = self.q_proj(hidden_states).view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
    K = self.k_proj(hidden_states).view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    V = self.v_proj(hidden_states).view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    kv_seq_len = K.shape[-2]

    if not HAS_FLASH_ATTENTION and HAS_XFORMERS and attention_mask is None:
        raise RuntimeError("xformers path not available here")
    elif HAS_FLASH_ATTENTION and attention_mask is None:
        raise RuntimeError("flash-attn path not available here")
    else:
        # Grouped query attention
        if n_groups != 1:
            K = K[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, kv_seq_len, head_dim)
            V = V[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, kv_seq_len, head_dim)
            K = K.reshape(bsz, n_heads, kv_seq_len, head_dim)
            V = V.reshape(bsz, n_heads, kv_seq_len, head_dim)
        if FIXED:
            # when qlen==vlen and attn_mask is None, we should use causal attention
            Q_len = Q.shape[-2]
            K_len = K.shape[-2]
            is_causal = attention_mask is None and Q_len == K_len
        else:
            is_causal = False
        # Must be contiguous or else results are False!
        Q, K, V = Q.contiguous(), K.contiguous(), V.contiguous()
        A = scaled_dot_product_attention(Q, K, V, attn_mask=attention_mask, is_causal=is_causal)
        A = A.transpose(1, 2).contiguous()
    attn_output = A.reshape(bsz, q_len, n_heads * head_dim)
    return self.o_proj(attn_output), None, past_key_value


LlamaAttention.forward = LlamaAttention_fast_forward


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.SiLU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, causal_mask=None, attention_mask=None, position_ids=None):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(self.input_layernorm(hidden_states), causal_mask=causal_mask,
                                             attention_mask=attention_mask, position_ids=position_ids)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return LlamaModel_fast_forward(self, input_ids, attention_mask=attention_mask, position_ids=position_ids)


def LlamaModel_fast_forward(self, input_ids, causal_mask=None, attention_mask=None, position_ids=None):
    inputs_embeds = self.embed_tokens(input_ids)
    # Ignore attention_mask
    if attention_mask is None:
        padding_mask = None
    elif self.training:
        attention_mask = None
        padding_mask = None
    else:
        raise NotImplementedError("inference path not reproduced here")
    hidden_states = inputs_embeds
    for decoder_layer in self.layers:
        hidden_states = decoder_layer(hidden_states, causal_mask=causal_mask, attention_mask=attention_mask,
                                      position_ids=position_ids)
    return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden_states = self.model(input_ids, attention_mask=attention_mask)
        logits = self.lm_head(hidden_states)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def main():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig())
    model.train()
    input_ids = torch.randint(1, 64, (2, 10))
    attention_mask = torch.ones_like(input_ids)
    loss = model(input_ids, attention_mask=attention_mask, labels=input_ids)
    loss.backward()
    print(f"{'fixed' if FIXED else 'buggy'} train loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
