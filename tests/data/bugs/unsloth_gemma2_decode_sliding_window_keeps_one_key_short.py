"""unsloth Gemma 2 fast decode: the sliding-window K/V slice keeps ``sliding_window - 1`` keys.

Citation: unslothai/unsloth#4100 ("Fix/pr 3699 leftpad prefill main", merged 2026-02-25, commit
0981c448c0), the part "Fix off-by-one in sliding window K/V slicing for gemma2, qwen3, falcon_h1, cohere"
in unsloth/models/gemma2.py ``Gemma2Attention_fast_forward_inference``.

Bug: at each decode step the sliding layers cut the cache with
``slicing_tokens = 1 - sliding_window; Knn = Kn[:, :, slicing_tokens:, :]`` -- negative indexing keeps
``sliding_window - 1`` keys (the commit: "with sliding_window=32 and kv_seq_len=100, 1-32 = -31 keeps
indices 69..99 (31 tokens) instead of the correct 68..99"), so the new token never saw the oldest key of
its window (transformers' definition: ``kv_idx > q_idx - W``, W keys).  The commit says Gemma 2
(sliding_window=4096) was the model actively affected.

Fix: ``start = kv_seq_len - sliding_window; Knn = Kn[:, :, start:, :]``.

This program keeps the decode function's shape (config ``sliding_window``, ``query_pre_attn_scalar``,
``attn_logit_softcapping``; Q scaled before ``Q @ K^T``; tanh softcapping; a hand-written softmax; GQA
expand) with a plain list-backed KV cache instead of the paged buffers, and no RoPE.  Prefill of 6 tokens
(SDPA with the window mask), then 3 decode steps with sliding_window=4 on the even (sliding) layers.
"""
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Gemma2Config:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    num_hidden_layers: int = 2
    sliding_window: int = 4
    query_pre_attn_scalar: int = 8
    attn_logit_softcapping: float = 50.0


class Gemma2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_sliding_window = layer_idx % 2 == 0
        self.scalar = 1.0 / math.sqrt(config.query_pre_attn_scalar)
        self.t = config.attn_logit_softcapping
        self.reciprocal_t = 1.0 / config.attn_logit_softcapping


def Gemma2Attention_prefill(self, X):
    """The first step (unsloth runs it through the regular forward): windowed causal SDPA, fills the cache."""
    bsz, q_len, _ = X.shape
    n_groups = self.num_heads // self.num_key_value_heads
    Q = self.q_proj(X).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    K = self.k_proj(X).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    V = self.v_proj(X).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    i = torch.arange(q_len)
    mask = i[None, :] <= i[:, None]
    if self.use_sliding_window:
        mask &= i[None, :] > i[:, None] - self.config.sliding_window
    A = F.scaled_dot_product_attention(Q, K.repeat_interleave(n_groups, 1), V.repeat_interleave(n_groups, 1),
                                       attn_mask=mask, scale=self.scalar)
    return self.o_proj(A.transpose(1, 2).reshape(bsz, q_len, -1)), (K, V)


def Gemma2Attention_fast_forward_inference(self, hidden_states, past_key_value, position_ids,
                                           do_prefill=False, attention_mask=None, use_sliding_window=False):
    Xn = hidden_states
    bsz, _, hd = hidden_states.size()
    K1, V1 = past_key_value
    n_heads = self.num_heads
    n_groups = self.num_heads // self.num_key_value_heads
    n_kv_heads = self.num_key_value_heads
    head_dim = self.head_dim
    attention_size = n_heads * head_dim
    seq_len = K1.shape[-2]
    kv_seq_len = seq_len + 1

    Qn = self.q_proj(Xn).view(bsz, 1, n_heads, head_dim).transpose(1, 2)
    Kn = self.k_proj(Xn).view(bsz, 1, n_kv_heads, head_dim).transpose(1, 2)
    Vn = self.v_proj(Xn).view(bsz, 1, n_kv_heads, head_dim).transpose(1, 2)

    # New KV cache
    Kn = torch.cat([K1, Kn], dim=2)
    Vn = torch.cat([V1, Vn], dim=2)

    # Handle sliding windows
    sliding_window = self.config.sliding_window
    if use_sliding_window and kv_seq_len > sliding_window:
        if FIXED:
            start = kv_seq_len - sliding_window
            Knn = Kn[:, :, start:, :]
            Vnn = Vn[:, :, start:, :]
        else:
            # From https://github.com/huggingface/transformers/blob/main/src/transformers/models/mistral/modeling_mistral.py#L193
            slicing_tokens = 1 - sliding_window
            Knn = Kn[:, :, slicing_tokens:, :]
            Vnn = Vn[:, :, slicing_tokens:, :]
    else:
        Knn, Vnn = Kn, Vn

    # Grouped query attention
    _, _, cached_len, _ = Knn.shape
    if n_groups != 1:
        Knn = Knn[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, cached_len, head_dim)
        Vnn = Vnn[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, cached_len, head_dim)
        Knn = Knn.reshape(bsz, n_heads, cached_len, head_dim)
        Vnn = Vnn.reshape(bsz, n_heads, cached_len, head_dim)

    # Attention
    Qn *= self.scalar  # (Q * scalar) @ K is better than (Q @ K) * scalar to stop overflows
    A = torch.matmul(Qn, Knn.transpose(2, 3))
    A *= self.reciprocal_t
    A = torch.tanh(A)
    A *= self.t  # Logit softcapping
    A = F.softmax(A, dim=-1, dtype=torch.float32)
    A = torch.matmul(A, Vnn)
    A = A.transpose(1, 2).reshape(bsz, 1, attention_size)
    return self.o_proj(A), (Kn, Vn)


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma2Attention(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def prefill(self, input_ids):
        h = self.embed_tokens(input_ids) * self.config.hidden_size ** 0.5
        cache = []
        for layer in self.layers:
            out, kv = Gemma2Attention_prefill(layer, h)
            h = h + out
            cache.append(kv)
        return self.lm_head(self.norm(h))[:, -1], cache

    def Gemma2Model_fast_forward_inference(self, input_ids, past_key_values, position_ids):
        h = self.embed_tokens(input_ids) * self.config.hidden_size ** 0.5
        next_decoder_cache = []
        for idx, layer in enumerate(self.layers):
            use_sliding_window = idx % 2 == 0
            out, present = Gemma2Attention_fast_forward_inference(
                layer, h, past_key_values[idx], position_ids, use_sliding_window=use_sliding_window)
            h = h + out
            next_decoder_cache.append(present)
        return self.lm_head(self.norm(h))[:, -1], next_decoder_cache


def main():
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config()).eval()
    input_ids = torch.randint(1, 64, (1, 6))
    generated = []
    with torch.no_grad():
        logits, cache = model.prefill(input_ids)
        token = logits.argmax(-1, keepdim=True)
        for step in range(3):
            generated.append(token.item())
            position_ids = torch.tensor([[6 + step]])
            logits, cache = model.Gemma2Model_fast_forward_inference(token, cache, position_ids)
            token = logits.argmax(-1, keepdim=True)
    print(f"{'fixed' if FIXED else 'buggy'} generated {generated} last logit {logits[0, 0].item():.4f}")


if __name__ == "__main__":
    main()
