"""TensorRT-LLM PyTorch backend: Mistral/Mixtral attention never passes `sliding_window` to the kernel.

Citation: NVIDIA/TensorRT-LLM PR #12597 ("[#11538][fix] Enable sliding window attention for
Mistral/Mixtral", addressing issues #11538 and #11244; description read). `MistralAttention` as it was
before the fix is read from `tensorrt_llm/_torch/models/modeling_mistral.py` (it only defines
`__init__`); the fixed `forward` is written from the PR description ("override forward() to pass
attention_window_size"), the way the other SWA models (Starcoder2, Gemma3, ...) do it.

Bug: the HF config says `sliding_window=4096`, but `MistralAttention` inherits `Attention.forward`,
which calls the attention backend with `attention_window_size=None`, so the FMHA kernel runs full
causal attention: every token beyond the window attends the whole prefix (wrong model, and O(N^2)).

Fix: `MistralAttention.forward` reads `config.sliding_window` and passes it as
`attention_window_size` down to the backend.

Reproduction: a stand-in `MistralConfig` (sliding_window=4), the `Attention` module / backend call
chain, a packed batch of two requests (10 and 6 tokens) described by `AttentionMetadata.seq_lens`;
the backend is a CPU reference that builds the causal (and windowed, when given) mask per request and
calls `F.scaled_dot_product_attention`.
"""
import sys
from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class MistralConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    sliding_window: Optional[int] = 4
    vocab_size: int = 64


@dataclass
class ModelConfig:
    pretrained_config: MistralConfig


class PredefinedAttentionMask(str, Enum):
    CAUSAL = "causal"
    FULL = "full"


@dataclass
class AttentionMetadata:
    seq_lens: torch.Tensor
    num_contexts: int


class TorchReferenceAttentionBackend:
    """Stand-in for the FMHA kernel: per-request causal (+ window) attention on packed tokens."""

    def forward(self, q, k, v, metadata: AttentionMetadata, attention_mask=PredefinedAttentionMask.CAUSAL,
                attention_window_size: Optional[int] = None):
        out = torch.empty_like(q)
        start = 0
        for n in metadata.seq_lens.tolist():
            pos = torch.arange(n)
            mask = pos[None, :] <= pos[:, None]
            if attention_window_size is not None:
                mask &= pos[:, None] - pos[None, :] < attention_window_size
            sl = slice(start, start + n)
            out[:, sl] = F.scaled_dot_product_attention(q[:, sl], k[:, sl], v[:, sl], attn_mask=mask,
                                                        enable_gqa=True)
            start += n
        return out


class Attention(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, num_key_value_heads, layer_idx, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_attention_heads, num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.layer_idx = layer_idx
        self.qkv_proj = torch.nn.Linear(hidden_size, (num_attention_heads + 2 * num_key_value_heads) * self.head_dim,
                                        bias=False)
        self.o_proj = torch.nn.Linear(num_attention_heads * self.head_dim, hidden_size, bias=False)
        self.attn = TorchReferenceAttentionBackend()

    def forward(self, position_ids, hidden_states, attn_metadata: AttentionMetadata,
                attention_mask=PredefinedAttentionMask.CAUSAL, attention_window_size: Optional[int] = None,
                **kwargs):
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1)
        to_heads = lambda t, h: t.view(-1, h, self.head_dim).transpose(0, 1)
        o = self.attn.forward(to_heads(q, self.num_heads), to_heads(k, self.num_kv_heads),
                              to_heads(v, self.num_kv_heads), attn_metadata, attention_mask=attention_mask,
                              attention_window_size=attention_window_size)
        return self.o_proj(o.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim))


class MistralAttention(Attention):
    def __init__(self, model_config: ModelConfig, layer_idx: Optional[int] = None):
        config = model_config.pretrained_config
        super().__init__(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                         num_key_value_heads=config.num_key_value_heads, layer_idx=layer_idx, config=model_config)
        if FIXED:
            self.attention_window_size = getattr(config, "sliding_window", None)

    if FIXED:
        def forward(self, position_ids, hidden_states, attn_metadata, attention_mask=PredefinedAttentionMask.CAUSAL,
                    **kwargs):
            return super().forward(position_ids=position_ids, hidden_states=hidden_states,
                                   attn_metadata=attn_metadata, attention_mask=attention_mask,
                                   attention_window_size=self.attention_window_size, **kwargs)


def main():
    model_config = ModelConfig(MistralConfig())
    config = model_config.pretrained_config
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    attn = MistralAttention(model_config, layer_idx=0)
    seq_lens: List[int] = [10, 6]
    input_ids = torch.randint(0, config.vocab_size, (sum(seq_lens),))
    position_ids = torch.cat([torch.arange(n) for n in seq_lens])
    metadata = AttentionMetadata(seq_lens=torch.tensor(seq_lens), num_contexts=len(seq_lens))
    with torch.no_grad():
        out = attn(position_ids, embed(input_ids), metadata)
    print("context output checksum", round(float(out.abs().sum()), 4))


if __name__ == "__main__":
    main()
