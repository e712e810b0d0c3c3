"""Megatron-Bridge Gemma 2 FlexAttention mask compares query-local indices with KV indices on decode.

Citation: NVIDIA-NeMo/Megatron-Bridge#5259 "[model] fix: align Gemma 2 cached decode masks" (merged
2026-08-03). PR text: "After prompt prefill, MCore passes a one-token query with the full cached
key/value prefix (`sq=1`, `sk>1`). FlexAttention mask callbacks receive query-local indices starting at
zero, but the Gemma 2 predicate previously compared those indices directly with KV indices. Every
cached decode layer therefore attended only KV position zero instead of the causal or recent
sliding-window range". Fix: "adds the right-alignment offset `sk - sq` before applying the existing
causal/window predicates. Equal-length prefill behavior is unchanged."

Bug: `Gemma2FlexDotProductAttention._build_flex_block_mask(sq, sk)` (pre-fix modeling_gemma2.py, read
from upstream) uses `q_idx >= kv_idx` and `q_idx - kv_idx <= w`.
Fix: the same predicates on `q_idx + (sk - sq)`. (The PR diff itself I could not read; the offset is
the one its description states.)

This program: the Megatron layout ([s, b, n, h]), Gemma 2 scale 1/sqrt(query_pre_attn_scalar) and
softcap score_mod, odd layers global and even layers sliding (`config.window_size = (3, 0)`), a
static KV cache filled by a 6-token prefill and then three one-token decode steps, each calling
`flex_attention` with a block mask built for (sq, sk). flex_attention runs eagerly here (upstream
wraps it in torch.compile).
"""
import math
import sys
import warnings
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv

# eager flex_attention on CPU warns that it is unfused; that is expected here
warnings.filterwarnings("ignore", message=".*flex_attention.*")

torch.manual_seed(0)


@dataclass
class Gemma2TransformerConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 8
    num_layers: int = 2
    window_size: tuple = (3, 0)
    query_pre_attn_scalar: float = 224.0
    attn_logit_softcapping: float = 50.0
    attention_dropout: float = 0.0


def _get_softcap_score_mod(softcap):
    def _score_mod(score, b, h, q_idx, kv_idx):
        if softcap == 0.0:
            return score
        return softcap * torch.tanh(score / softcap)

    return _score_mod


class Gemma2FlexDotProductAttention(torch.nn.Module):
    """Gemma2 fused attention with native softcap and sliding window support."""

    def __init__(self, config, layer_number):
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.window_size = None
        if self.layer_number % 2 == 0:
            self.window_size = config.window_size
        self.norm_factor = math.sqrt(config.query_pre_attn_scalar)
        self.softcap = float(config.attn_logit_softcapping or 0.0)
        self.softmax_scale = 1.0 / self.norm_factor
        # window_size for FlexAttention block_mask: (-1, -1) = full causal; (left, right) = SWA
        self._flex_window_size = (-1, -1) if self.window_size is None else (self.window_size[0], self.window_size[1])
        self._flex_score_mod = _get_softcap_score_mod(self.softcap)
        self._flex_block_mask_cache = {}

    def _build_flex_block_mask(self, sq, sk, device):
        """Build a FlexAttention block_mask encoding causal + optional SWA."""
        window_left = self._flex_window_size[0]
        # decode: the sq queries are the last sq positions of the sk keys
        offset = sk - sq if FIXED else 0
        if window_left < 0:

            def _mask(b, h, q_idx, kv_idx, _off=offset):
                return q_idx + _off >= kv_idx

        else:
            w = window_left

            def _mask(b, h, q_idx, kv_idx, _w=w, _off=offset):
                return (q_idx + _off >= kv_idx) & (q_idx + _off - kv_idx <= _w)

        return create_block_mask(_mask, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=device)

    def forward(self, query, key, value, attention_mask=None):
        # FlexAttention path -- expects [b, np, sq, hn]
        sq, b, np_heads, hn = query.shape
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        cache_key = (sq, key.size(0))
        if cache_key not in self._flex_block_mask_cache:
            self._flex_block_mask_cache[cache_key] = self._build_flex_block_mask(sq, key.size(0), query.device)
        out = flex_attention(q, k, v, score_mod=self._flex_score_mod,
                             block_mask=self._flex_block_mask_cache[cache_key],
                             scale=self.softmax_scale, enable_gqa=True)
        # [b, np, sq, hn] -> [sq, b, hp]
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_heads * hn)


class InferenceContext:
    """Static KV cache of legacy generation: key_value_memory_dict[layer] = (k, v) [max_s, b, ng, hn]."""

    def __init__(self, max_sequence_length, max_batch_size):
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.key_value_memory_dict = {}


class SelfAttention(torch.nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.np, self.ng, self.hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
        self.linear_qkv = torch.nn.Linear(config.hidden_size, (self.np + 2 * self.ng) * self.hn, bias=False)
        self.linear_proj = torch.nn.Linear(self.np * self.hn, config.hidden_size, bias=False)
        self.core_attention = Gemma2FlexDotProductAttention(config, layer_number)

    def forward(self, hidden_states, inference_context):
        s, b, _ = hidden_states.shape
        q, k, v = self.linear_qkv(hidden_states).split(
            [self.np * self.hn, self.ng * self.hn, self.ng * self.hn], dim=-1)
        q = q.view(s, b, self.np, self.hn)
        k = k.view(s, b, self.ng, self.hn)
        v = v.view(s, b, self.ng, self.hn)
        if self.layer_number not in inference_context.key_value_memory_dict:
            shape = (inference_context.max_sequence_length, inference_context.max_batch_size, self.ng, self.hn)
            inference_context.key_value_memory_dict[self.layer_number] = (torch.zeros(shape), torch.zeros(shape))
        k_mem, v_mem = inference_context.key_value_memory_dict[self.layer_number]
        start = inference_context.sequence_len_offset
        k_mem[start:start + s, :b] = k
        v_mem[start:start + s, :b] = v
        k = k_mem[:start + s, :b]
        v = v_mem[:start + s, :b]
        # legacy static generation passes no padding mask: the fused FlexAttention path is taken
        out = self.core_attention(q, k, v, attention_mask=None)
        return self.linear_proj(out)


class Gemma2Model(torch.nn.Module):
    def __init__(self, config, vocab_size=64):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(SelfAttention(config, i + 1) for i in range(config.num_layers))
        self.output_layer = torch.nn.Linear(config.hidden_size, vocab_size, bias=False)

    def forward(self, tokens, inference_context):
        h = self.embedding(tokens).transpose(0, 1)  # [s, b, h]
        for layer in self.layers:
            h = h + layer(h, inference_context)
        inference_context.sequence_len_offset += tokens.shape[1]
        return self.output_layer(h).transpose(0, 1)


def main():
    config = Gemma2TransformerConfig()
    model = Gemma2Model(config).eval()
    prompt = torch.tensor([[5, 9, 2, 33, 17, 8]])
    ctx = InferenceContext(max_sequence_length=16, max_batch_size=1)
    tokens = prompt
    with torch.no_grad():
        logits = model(tokens, ctx)
        out = []
        for _ in range(3):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt.item())
            logits = model(nxt, ctx)
    print("generated:", out, "last logit sum:", round(logits.sum().item(), 4))


if __name__ == "__main__":
    main()
