"""vLLM V1 FlashAttentionImpl passes window_size=(sliding_window, sliding_window) to the kernel.

Citation: vllm-project/vllm#9679 ("[V1] Support sliding window attention", merged 2024-10-25), which
ports to V1 the change of vllm-project/vllm#9403. The review thread of #9679 shows the hunk in
vllm/v1/attention/backends/flash_attn.py:

    -        self.sliding_window = ((sliding_window, sliding_window)
    -                               if sliding_window is not None else (-1, -1))
    +        if sliding_window is None:
    +            self.sliding_window = (-1, -1)
    +        else:
    +            self.sliding_window = (sliding_window - 1, 0)

Bug: flash-attn's window_size is inclusive: a query at i sees keys in [i - left, i + right]. With
left = sliding_window the causal kernel lets every query see sliding_window + 1 keys (one key older
than the model's window, e.g. Mistral's config.sliding_window). Fix: (sliding_window - 1, 0).
I read only the PR description and this hunk (not the thread of #9403).

Reproduction: a torch port of the V1 backend's prefill path. flash_attn_varlen_func is emulated with
F.scaled_dot_product_attention per sequence of the batch (cu_seqlens), with the kernel's documented
window semantics; the engine's code (impl, metadata, forward) keeps vLLM's names. Two prompts of 7
and 9 tokens, sliding_window=4: from the 5th token on every query sees one key too many.
"""
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1),
                           alibi_slopes=None, out=None):
    """CPU stand-in for vllm_flash_attn.flash_attn_varlen_func (same window semantics).

    Query i of a sequence sees key j when i + sk - sq - window_size[0] <= j <= i + sk - sq +
    window_size[1] (a bound of -1 is unbounded); causal forces the right bound to 0.
    """
    left, right = window_size
    if causal:
        right = 0
    outs = []
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        sq, sk = qe - qs, ke - ks
        qi = torch.arange(sq).unsqueeze(1) + (sk - sq)
        kj = torch.arange(sk).unsqueeze(0)
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if right >= 0:
            allowed &= kj <= qi + right
        if left >= 0:
            allowed &= kj >= qi - left
        qb = q[qs:qe].transpose(0, 1)          # [heads, sq, d]
        kb = k[ks:ke].transpose(0, 1)
        vb = v[ks:ke].transpose(0, 1)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=softmax_scale)
        outs.append(o.transpose(0, 1))
    res = torch.cat(outs, dim=0)
    if out is not None:
        out.copy_(res)
        return out
    return res


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_start_loc: torch.Tensor


class FlashAttentionImpl:

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[List[float]], sliding_window: Optional[int],
                 kv_cache_dtype: str = "auto"):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = alibi_slopes
        if FIXED:
            if sliding_window is None:
                self.sliding_window = (-1, -1)
            else:
                self.sliding_window = (sliding_window - 1, 0)
        else:
            self.sliding_window = ((sliding_window, sliding_window)
                                   if sliding_window is not None else (-1, -1))
        self.kv_cache_dtype = kv_cache_dtype

    def forward(self, query, key, value, attn_metadata: FlashAttentionMetadata, output):
        num_actual_tokens = attn_metadata.num_actual_tokens
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)
        flash_attn_varlen_func(
            q=query[:num_actual_tokens],
            k=key[:num_actual_tokens],
            v=value[:num_actual_tokens],
            out=output[:num_actual_tokens],
            cu_seqlens_q=attn_metadata.query_start_loc,
            max_seqlen_q=attn_metadata.max_query_len,
            cu_seqlens_k=attn_metadata.seq_start_loc,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            alibi_slopes=self.alibi_slopes,
            window_size=self.sliding_window,
        )
        return output


def main():
    torch.manual_seed(0)
    # Mistral-style config: every layer uses the sliding window.
    hf_config = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                 "sliding_window": 4}
    seq_lens = [7, 9]
    num_heads, head_size = hf_config["num_attention_heads"], hf_config["head_dim"]
    impl = FlashAttentionImpl(num_heads, head_size, head_size ** -0.5,
                              hf_config["num_key_value_heads"], None, hf_config["sliding_window"])
    query_start_loc = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0)), dtype=torch.int32)
    meta = FlashAttentionMetadata(num_actual_tokens=sum(seq_lens), max_query_len=max(seq_lens),
                                  query_start_loc=query_start_loc, max_seq_len=max(seq_lens),
                                  seq_start_loc=query_start_loc.clone())
    n = sum(seq_lens)
    q = torch.randn(n, num_heads * head_size)
    k = torch.randn(n, num_heads * head_size)
    v = torch.randn(n, num_heads * head_size)
    out = torch.empty(n, num_heads, head_size)
    impl.forward(q, k, v, meta, out)
    print("window_size", impl.sliding_window, "out[-1,0,:3]", out[-1, 0, :3].tolist())


if __name__ == "__main__":
    main()
