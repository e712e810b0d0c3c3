"""Unsloth: the SDPA fallback of LlamaAttention_fast_forward is never causal.

Citation: unslothai/unsloth PR #2868 ("[bugs] fix for casual mask", merged; description and the
`unsloth/models/llama.py` review hunk read). The surrounding Unsloth code (LlamaModel_fast_forward,
the single-token `LlamaAttention_fast_forward_inference` decode path) is reconstructed from the names in
that file, simplified.

Bug: "when flash_attn and xformers optimizations are not used, is_causal=False is always passed into
scaled_dot_product_attention even when attention_mask is None". The other kernels get `causal = True`
themselves, so when the prompt carries no attention_mask (an unpadded prompt), on machines without
FlashAttention and xFormers (CPU, XPU, ...) every prompt token attends to later prompt tokens. In inference the prefill goes
through this path, so the KV cache written for the prompt is already wrong before decoding starts.

Fix: `is_causal = True` when `attention_mask is None and Q_len == K_len`, else False; pass it to SDPA.

Reproduction: a 2-layer Llama-style model with GQA (4 query / 2 KV heads), HAS_FLASH_ATTENTION and
HAS_XFORMERS False, SDPA_HAS_GQA True; prefill of 7 tokens (no padding,
`attention_mask=None`), then 3 cached decode steps through the single-token inference path.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention

FIXED = "--fixed" in sys.argv
HAS_FLASH_ATTENTION = False
HAS_XFORMERS = False
SDPA_HAS_GQA = True


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)


def LlamaAttention_fast_forward(self, hidden_states, attention_mask=None, past_key_value=None):
    bsz, q_len, _ = hidden_states.size()
    n_heads, n_kv_heads, head_dim = self.num_heads, self.num_key_value_heads, self.head_dim
    n_groups = n_heads // n_kv_heads
    Q = self.q_proj(hidden_states).view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
    K = self.k_proj(hidden_states).view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    V = self.v_proj(hidden_states).view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    if past_key_value is not None:
        K = torch.cat([past_key_value[0], K], dim=2)
        V = torch.cat([past_key_value[1], V], dim=2)
    past_key_value = (K, V)
    if not HAS_FLASH_ATTENTION and not HAS_XFORMERS:
        if FIXED:
            # when qlen==vlen and attn_mask is None, we should use causal attention
            Q_len = Q.shape[-2]
            K_len = K.shape[-2]
            is_causal = attention_mask is None and Q_len == K_len
        else:
            is_causal = False
        if SDPA_HAS_GQA:
            A = scaled_dot_product_attention(Q, K, V, attn_mask=attention_mask, is_causal=is_causal,
                                             enable_gqa=n_groups != 1)
            A = A.transpose(1, 2)
    attn_output = A.reshape(bsz, q_len, n_heads * head_dim)
    return self.o_proj(attn_output), past_key_value


def LlamaAttention_fast_forward_inference(self, hidden_states, past_key_value):
    """Single-token decode: the new query attends every cached key, so no mask is needed."""
    bsz, _, _ = hidden_states.size()
    Qn = self.q_proj(hidden_states).view(bsz, 1, self.num_heads, self.head_dim).transpose(1, 2)
    Kn = self.k_proj(hidden_states).view(bsz, 1, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    Vn = self.v_proj(hidden_states).view(bsz, 1, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    Kn = torch.cat([past_key_value[0], Kn], dim=2)
    Vn = torch.cat([past_key_value[1], Vn], dim=2)
    A = scaled_dot_product_attention(Qn, Kn, Vn, attn_mask=None, is_causal=False, enable_gqa=True)
    return self.o_proj(A.transpose(1, 2).reshape(bsz, 1, -1)), (Kn, Vn)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaAttention(config) for _ in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        hidden_states = self.embed_tokens(input_ids)
        next_cache = []
        for i, layer in enumerate(self.layers):
            residual = hidden_states
            h = F.rms_norm(hidden_states, (hidden_states.shape[-1],))
            if past_key_values is not None and input_ids.shape[1] == 1:
                h, kv = LlamaAttention_fast_forward_inference(layer, h, past_key_values[i])
            else:
                h, kv = LlamaAttention_fast_forward(layer, h, attention_mask,
                                                    past_key_values[i] if past_key_values is not None else None)
            hidden_states = residual + h
            next_cache.append(kv)
        return self.lm_head(hidden_states), next_cache


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2)
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(0, 64, (1, 7))
    out = []
    with torch.no_grad():
        logits, past = model(input_ids)  # unpadded prompt: no attention_mask
        for _ in range(3):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt.item())
            logits, past = model(nxt, past_key_values=past)
    print("generated", out, "last logit sum %.4f" % logits.sum().item())


if __name__ == "__main__":
    main()
