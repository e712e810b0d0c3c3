"""tokenspeed MHA backend: the extend (prefill-with-KV-cache) kernel assumes no causal masking.

Citation: lightseekorg/tokenspeed#271, "fix: missing causal mask for attn extend kernel" (merged);
the PR says the regression came from commit 294830e, the split-prefill change (I take it to be
lightseekorg/tokenspeed#178, "use split prefill for prefix cache in mha backend"). I read the PR description and its review threads, not the whole diff; the
kernel is replaced here by a torch reference with the same arguments (paged K/V cache, page_table,
cache_seqlens that already include the new tokens, cu_seqlens_q, max_seqlen_q / max_seqlen_k,
softmax_scale, is_causal), and the backend by the extend call that chooses those arguments.

Bug: #178 split prefix-cached prefill into "attend to the cached prefix" + "attend within the new
chunk", and changed the MHA extend-with-KV-cache kernel to run with no causal mask, which is right
for the prefix part only. Standalone extend calls (speculative-decoding verify, which appends a
block of draft tokens to a cached prefix) went through the same kernel, so earlier draft tokens
attended to later ones (the KV cache already holds the whole appended chunk).

Fix: add the is_causal flag back to the extend kernel and default to causal on the MHA backend's
extend path.

Reproduction: two requests with cached prefixes of 6 and 3 tokens, each verifying 3 draft tokens
in one extend; page size 4. Attention is F.scaled_dot_product_attention per request over the
K/V gathered through the page table.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ExtendMetadata:
    cu_seqlens_q: torch.Tensor
    cache_seqlens: torch.Tensor  # includes the tokens of this extend
    page_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def mha_extend_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                            max_seqlen_q, max_seqlen_k, softmax_scale=None, is_causal=False):
    """Reference for the extend kernel: q is ragged [total_q, H, D]; K/V live in pages [n_pages, page, H, D]."""
    page_size = k_cache.shape[1]
    outs = []
    for i in range(cache_seqlens.shape[0]):
        q_i = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]
        kv_len = int(cache_seqlens[i])
        pos = torch.arange(kv_len)
        pages = page_table[i, pos // page_size]
        k_i = k_cache[pages, pos % page_size]
        v_i = v_cache[pages, pos % page_size]
        mask = None
        if is_causal:
            q_len = q_i.shape[0]
            q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
            mask = pos[None, :] <= q_pos  # bottom-right aligned: the chunk sits at the end of the cache
        o = F.scaled_dot_product_attention(
            q_i.transpose(0, 1), k_i.transpose(0, 1), v_i.transpose(0, 1), attn_mask=mask, scale=softmax_scale
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


class MHABackend:
    def __init__(self, k_cache, v_cache, softmax_scale):
        self.k_cache, self.v_cache, self.softmax_scale = k_cache, v_cache, softmax_scale

    def forward_extend(self, q, md: ExtendMetadata):
        kwargs = dict(softmax_scale=self.softmax_scale)
        if FIXED:
            kwargs["is_causal"] = True
        return mha_extend_with_kvcache(
            q, self.k_cache, self.v_cache, md.page_table, md.cache_seqlens, md.cu_seqlens_q,
            md.max_seqlen_q, md.max_seqlen_k, **kwargs,
        )


def main():
    torch.manual_seed(0)
    H, D, page_size, n_pages = 2, 8, 4, 8
    k_cache = torch.randn(n_pages, page_size, H, D)
    v_cache = torch.randn(n_pages, page_size, H, D)
    prefix_lens = torch.tensor([6, 3])
    draft_len = 3
    cache_seqlens = prefix_lens + draft_len  # draft K/V already written before attention
    page_table = torch.tensor([[5, 2, 7], [0, 4, 1]])
    md = ExtendMetadata(
        cu_seqlens_q=torch.tensor([0, draft_len, 2 * draft_len]),
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        max_seqlen_q=draft_len,
        max_seqlen_k=int(cache_seqlens.max()),
    )
    backend = MHABackend(k_cache, v_cache, softmax_scale=D ** -0.5)
    q = torch.randn(2 * draft_len, H, D)
    out = backend.forward_extend(q, md)
    print("verify output norms:", [round(x, 3) for x in out.flatten(1).norm(dim=1).tolist()])


if __name__ == "__main__":
    main()
