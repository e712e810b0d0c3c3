"""vLLM Gemma 4: an image span longer than the sliding window loses its bidirectional attention entirely.

Citation: vllm-project/vllm#47217 ("[Bugfix][Gemma4] Keep image bidirectional attention within the sliding
window", merged); the guard it replaced came from vllm-project/vllm#40534.

Bug: for Gemma 4 with ``use_bidirectional_attention == "vision"`` the GPU model runner builds, per request,
the ``mm_prefix_range`` list (one ``(start, end)`` per image's soft tokens) that the attention backends turn
into a blockwise-bidirectional mask on the sliding layers.  #40534 added a guard that skipped a range
whenever ``range_len > sliding_window``, so an image whose span exceeds the text sliding window ran fully
causal in the LM (the PR: "dropped the *entire* bidirectional mm_prefix range ... leaving those image tokens
fully causal").

Fix: keep every range and clamp it on sliding layers: ``(causal OR blockwise) AND sliding_window``.  Full
attention layers stay causal-only (``_clear_mm_prefix_for_full_attn_layers``).

This program writes the runner's range building and a torch reference of the backend's mask (the mask the
kernels compute, applied to ``F.scaled_dot_product_attention``).  The text config says sliding_window=6 and
``use_bidirectional_attention="vision"``; one request holds an 8-token image (positions 2..9) and a
3-token image (11..13).  Buggy: the 8-token image is causal on the sliding layer; fixed: bidirectional
within the window.  The small image is bidirectional in both.  Only the PR descriptions were read.
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Gemma4TextConfig:
    model_type: str = "gemma4_text"
    hidden_size: int = 32
    num_attention_heads: int = 4
    sliding_window: int = 6
    use_bidirectional_attention: str = "vision"
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])
    vocab_size: int = 64


@dataclass
class Gemma4Config:
    model_type: str = "gemma4"
    text_config: Gemma4TextConfig = field(default_factory=Gemma4TextConfig)
    image_token_id: int = 7


@dataclass
class ModelConfig:
    hf_config: Gemma4Config

    @property
    def hf_text_config(self):
        return self.hf_config.text_config


class GPUModelRunner:
    def __init__(self, model_config: ModelConfig):
        self.model_config = model_config

    def _build_mm_prefix_ranges(self, mm_positions):
        """One request's (start, end) inclusive ranges of image soft tokens."""
        hf_text_config = self.model_config.hf_text_config
        _bidi_sw = None
        if (
            getattr(self.model_config.hf_config, "model_type", None) == "gemma4"
            and getattr(hf_text_config, "use_bidirectional_attention", None) == "vision"
        ):
            _bidi_sw = getattr(hf_text_config, "sliding_window", None)
        ranges = []
        for offset, length in mm_positions:
            start, end = offset, offset + length - 1
            range_len = end - start + 1
            if not FIXED and _bidi_sw is not None and range_len > _bidi_sw:
                # oversized image: keep it causal rather than attending the whole image
                continue
            ranges.append((start, end))
        return ranges


def build_attn_mask(seq_len, mm_prefix_range, sliding_window=None):
    """Reference of the backend's mask: causal OR same-image, clamped to the window on sliding layers."""
    q = torch.arange(seq_len)[:, None]
    k = torch.arange(seq_len)[None, :]
    allowed = k <= q
    for start, end in mm_prefix_range:
        in_q = (q >= start) & (q <= end)
        in_k = (k >= start) & (k <= end)
        allowed = allowed | (in_q & in_k)
    if sliding_window is not None:
        if FIXED:
            allowed = allowed & ((q - k).abs() < sliding_window)
        else:
            allowed = allowed & (q - k < sliding_window)
    return allowed


class Gemma4Attention(nn.Module):
    def __init__(self, config: Gemma4TextConfig, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None

    def forward(self, hidden_states, mm_prefix_range):
        L = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        q, k, v = (t.view(L, self.num_heads, self.head_dim).transpose(0, 1) for t in (q, k, v))
        if not self.is_sliding:
            # _clear_mm_prefix_for_full_attn_layers: global layers are causal-only
            mm_prefix_range = []
        mask = build_attn_mask(L, mm_prefix_range, self.sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(0, 1).reshape(L, -1))


class Gemma4ForConditionalGeneration(nn.Module):
    def __init__(self, config: Gemma4Config):
        super().__init__()
        tc = config.text_config
        self.embed_tokens = nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.layers = nn.ModuleList([Gemma4Attention(tc, i) for i in range(len(tc.layer_types))])

    def forward(self, input_ids, mm_prefix_range):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = h + layer(h, mm_prefix_range)
        return h


def main():
    torch.manual_seed(0)
    config = Gemma4Config()
    runner = GPUModelRunner(ModelConfig(hf_config=config))
    model = Gemma4ForConditionalGeneration(config).eval()
    img = config.image_token_id
    input_ids = torch.tensor([2, 11] + [img] * 8 + [12] + [img] * 3 + [13, 14])
    mm_positions = [(2, 8), (11, 3)]
    mm_prefix_range = runner._build_mm_prefix_ranges(mm_positions)
    with torch.no_grad():
        out = model(input_ids, mm_prefix_range)
    print(f"{'fixed' if FIXED else 'buggy'} ranges {mm_prefix_range} out {out.sum().item():.4f}")


if __name__ == "__main__":
    main()
