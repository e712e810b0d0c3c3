"""Megatron-Bridge: the Mistral bridge hands HF's `sliding_window` to Megatron as `window_size=(W, 0)`.

Citation: NVIDIA-NeMo/Megatron-Bridge PR #2656, "[bridge] Fix off-by-one in sliding window size for
Gemma2, Gemma3, Mistral, and GPT-OSS" (merged; PR description read, diff not re-read, so the bridge and
attention code below are a small port written from that description).

Bug: Megatron / Transformer Engine take `window_size` as a FlashAttention `(left, right)` tuple with
inclusive bounds: query i attends keys [i - left, i + right]. HF's `sliding_window` is the total number
of keys a query sees, current token included. The Mistral bridge passed `(sliding_window, 0)`, so every
query past the window attended `sliding_window + 1` keys, one more than the HF model.

Fix: subtract one when converting: `window_size=(hf_config.sliding_window - 1, 0)`.

Reproduction: an HF-style MistralConfig (a dataclass with `sliding_window = 4`), the bridge's
`provider_bridge` building a GPTModelProvider, and a TE-style unfused DotProductAttention that turns
`attn_mask_type="causal"` plus `window_size` into a boolean mask for `F.scaled_dot_product_attention`
(sequence of 10 tokens, so queries 4..9 are past the window).
"""
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class MistralConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    sliding_window: Optional[int] = 4
    rope_theta: float = 10000.0


@dataclass
class GPTModelProvider:
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    num_layers: int
    window_size: Optional[Tuple[int, int]] = None
    attn_mask_type: str = "causal"


class MistralBridge:
    def provider_bridge(self, hf_config: MistralConfig) -> GPTModelProvider:
        window_size = None
        if hf_config.sliding_window is not None:
            if FIXED:
                # FlashAttention/TE window bounds are inclusive: (W - 1, 0) covers W keys.
                window_size = (hf_config.sliding_window - 1, 0)
            else:
                window_size = (hf_config.sliding_window, 0)
        return GPTModelProvider(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_query_groups=hf_config.num_key_value_heads,
            num_layers=hf_config.num_hidden_layers,
            window_size=window_size,
        )


def get_full_mask(max_seqlen_q, max_seqlen_kv, attn_mask_type="causal", window_size=None):
    """TE-style mask: True = keep. Query i sees keys [i - left, i + right] (bottom-right aligned)."""
    q = torch.arange(max_seqlen_q).view(-1, 1) + (max_seqlen_kv - max_seqlen_q)
    k = torch.arange(max_seqlen_kv).view(1, -1)
    left, right = window_size if window_size is not None else (-1, -1)
    if attn_mask_type == "causal":
        right = 0
    keep = torch.ones(max_seqlen_q, max_seqlen_kv, dtype=torch.bool)
    if left >= 0:
        keep &= k >= q - left
    if right >= 0:
        keep &= k <= q + right
    return keep


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads, num_query_groups, attn_mask_type, window_size):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.num_query_groups = num_query_groups
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size

    def forward(self, query, key, value):
        # query/key/value: [s, b, h, d] (Megatron's sbhd layout)
        sq, sk = query.shape[0], key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        rep = self.num_attention_heads // self.num_query_groups
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        mask = get_full_mask(sq, sk, self.attn_mask_type, self.window_size)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], -1)


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTModelProvider):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv = cfg.num_query_groups * self.head_dim
        self.linear_qkv = nn.Linear(cfg.hidden_size, cfg.hidden_size + 2 * kv)
        self.linear_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.core_attention = DotProductAttention(cfg.num_attention_heads, cfg.num_query_groups,
                                                  cfg.attn_mask_type, cfg.window_size)

    def forward(self, hidden_states):
        s, b, _ = hidden_states.shape
        kv = self.cfg.num_query_groups * self.head_dim
        q, k, v = self.linear_qkv(hidden_states).split([self.cfg.hidden_size, kv, kv], dim=-1)
        q = q.view(s, b, self.cfg.num_attention_heads, self.head_dim)
        k = k.view(s, b, self.cfg.num_query_groups, self.head_dim)
        v = v.view(s, b, self.cfg.num_query_groups, self.head_dim)
        return self.linear_proj(self.core_attention(q, k, v))


class GPTModel(nn.Module):
    def __init__(self, cfg: GPTModelProvider):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(SelfAttention(cfg) for _ in range(cfg.num_layers))
        self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        h = self.embedding(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        for layer in self.layers:
            h = h + layer(h)
        return self.output_layer(h).transpose(0, 1)


def main():
    torch.manual_seed(0)
    hf_config = MistralConfig()
    provider = MistralBridge().provider_bridge(hf_config)
    model = GPTModel(provider).eval()
    input_ids = torch.randint(0, hf_config.vocab_size, (2, 10))
    with torch.no_grad():
        logits = model(input_ids)
    print("window_size", provider.window_size, "logits", tuple(logits.shape),
          "sum %.4f" % logits.sum().item())


if __name__ == "__main__":
    main()
