"""vLLM FlashAttention-4 backend: the mm_prefix `mask_mod` drops the sliding window and uses chunk-local q_idx.

Citation: vllm-project/vllm PR #47332 ("[Bugfix][Gemma4] Fix FA4 mm_prefix mask: add sliding window and
absolute q_idx"), fixing issue #47300 (Gemma4 gibberish on long multimodal prompts with FA4 on SM90).
Read from the PR description and the post-fix `_make_mm_prefix_mask_mod` in
`vllm/v1/attention/backends/flash_attn.py`; the pre-fix body below is written from the PR's statement
of the two bugs, the CuTe-DSL mask_mod is ported to a FlexAttention-style `mask_mod(b, h, q_idx, kv_idx)` with the same
convention (local q_idx, absolute kv_idx). The kernel is replaced by evaluating the mask_mod on broadcast
index grids (as FlexAttention's `create_mask` does) and calling `F.scaled_dot_product_attention`.

Bug: for PrefixLM models (Gemma4 images attend bidirectionally) the FA4 call gets a `mask_mod` and the
backend turns the kernel's own causal/local masking off, so the `mask_mod` is the only element mask.
It implemented `causal OR mm_prefix` (no sliding-window term on a sliding layer) and compared the
kernel's *chunk-local* `q_idx` against *absolute* `kv_idx` and absolute image ranges, which is wrong
whenever `seqlen_q != seqlen_k` (chunked prefill / prefix caching).

Fix: `q_abs = q_idx + seqlen_k - seqlen_q`; keep = `(kv_idx <= q_abs & q_abs - kv_idx < window) OR
(kv_idx in the query's image range)`.

Reproduction: a Gemma4-like sliding layer (`sliding_window = 6`), one request whose first 12 tokens are
already in the KV cache and whose next chunk of 8 tokens (absolute 12..19) contains an image at
absolute positions [14, 17]; the mask_mod is evaluated over (Q_LEN=8, KV_LEN=20).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Gemma4TextConfig:
    hidden_size: int = 32
    num_attention_heads: int = 2
    head_dim: int = 16
    sliding_window: int = 6
    layer_types: tuple = ("sliding_attention", "full_attention")


@dataclass
class FlashAttentionMetadata:
    query_start_loc: torch.Tensor     # cu_seqlens_q
    seq_lens: torch.Tensor            # seqlen_k per request (context + scheduled)
    mm_prefix_range_tensor: torch.Tensor  # [num_reqs, max_ranges, 2], absolute [start, end], -1 pad


def _make_mm_prefix_mask_mod(max_ranges, seqlen_q, seqlen_k, mm_ranges, sliding_window_left=None):
    """mask_mod for a single request: FA4 hands q_idx local to the chunk, kv_idx absolute."""
    if FIXED:
        ctx_off = seqlen_k - seqlen_q

        def mm_prefix_mask_mod(b, h, q_idx, kv_idx):
            q_abs = q_idx + ctx_off
            keep = kv_idx <= q_abs
            if sliding_window_left is not None:
                keep = keep & ((q_abs - kv_idx) < sliding_window_left)
            for r in range(max_ranges):
                start, end = mm_ranges[b, r, 0], mm_ranges[b, r, 1]
                keep = keep | ((q_abs >= start) & (q_abs <= end) & (kv_idx >= start) & (kv_idx <= end))
            return keep
    else:
        def mm_prefix_mask_mod(b, h, q_idx, kv_idx):
            keep = kv_idx <= q_idx
            for r in range(max_ranges):
                start, end = mm_ranges[b, r, 0], mm_ranges[b, r, 1]
                keep = keep | ((q_idx >= start) & (q_idx <= end) & (kv_idx >= start) & (kv_idx <= end))
            return keep
    return mm_prefix_mask_mod


class FlashAttentionImpl:
    def __init__(self, config, layer_idx):
        self.num_heads = config.num_attention_heads
        self.scale = config.head_dim ** -0.5
        if config.layer_types[layer_idx] == "sliding_attention":
            self.sliding_window = (config.sliding_window - 1, 0)
        else:
            self.sliding_window = (-1, -1)

    def forward(self, query, key_cache, value_cache, attn_metadata):
        seqlen_q = int(attn_metadata.query_start_loc[1] - attn_metadata.query_start_loc[0])
        seqlen_k = int(attn_metadata.seq_lens[0])
        mm_prefix_ranges = attn_metadata.mm_prefix_range_tensor
        max_ranges = mm_prefix_ranges.shape[1]
        sliding_window_left = self.sliding_window[0] + 1 if self.sliding_window[0] >= 0 else None
        # with a mask_mod the kernel's causal/local flags are cleared: the mask_mod is the only mask
        mm_mask_mod = _make_mm_prefix_mask_mod(max_ranges, seqlen_q, seqlen_k, mm_prefix_ranges,
                                               sliding_window_left)
        # the kernel evaluates mask_mod per (q_idx, kv_idx) element
        b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        q_idx = torch.arange(seqlen_q)[None, None, :, None]
        kv_idx = torch.arange(seqlen_k)[None, None, None, :]
        mask = mm_mask_mod(b, h, q_idx, kv_idx)
        q = query.view(1, seqlen_q, self.num_heads, -1).transpose(1, 2)
        k = key_cache[:seqlen_k].view(1, seqlen_k, self.num_heads, -1).transpose(1, 2)
        v = value_cache[:seqlen_k].view(1, seqlen_k, self.num_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.transpose(1, 2).reshape(seqlen_q, -1)


def main():
    config = Gemma4TextConfig()
    impl = FlashAttentionImpl(config, layer_idx=0)
    num_computed_tokens, num_scheduled_tokens = 12, 8
    seq_len = num_computed_tokens + num_scheduled_tokens
    key_cache = torch.randn(32, config.num_attention_heads * config.head_dim)
    value_cache = torch.randn(32, config.num_attention_heads * config.head_dim)
    query = torch.randn(num_scheduled_tokens, config.num_attention_heads * config.head_dim)
    meta = FlashAttentionMetadata(
        query_start_loc=torch.tensor([0, num_scheduled_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        mm_prefix_range_tensor=torch.tensor([[[14, 17], [-1, -1]]], dtype=torch.int32),
    )
    with torch.no_grad():
        out = impl.forward(query, key_cache, value_cache, meta)
    print("sliding layer chunk output checksum", round(float(out.abs().sum()), 4))


if __name__ == "__main__":
    main()
