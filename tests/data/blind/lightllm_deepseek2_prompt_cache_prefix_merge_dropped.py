"""LightLLM DeepSeek-V2 FA3 prefill with prompt cache: the prefix attention is merged, then dropped.

Citation: ModelTC/LightLLM#893 (commit 28de11261, "fix fa3 prompt cache for
dsv3"), read in the upstream git history
(lightllm/models/deepseek2/layer_infer/transformer_layer_infer.py).

Bug: `_context_attention_flashattention_kernel_with_CC` (adapted from sglang)
attends the new prompt tokens causally to themselves, then, when the request
hit the prompt (radix) cache (`infer_state.has_prefix_kv`), attends the same
queries non-causally to the cached prefix K/V and merges the two partial
results with `merge_state_v2(prefix_output, prefix_lse, o_tensor, lse,
tmp_output, tmp_lse)`. It then returned `o_tensor`, the new-token-only part,
so the cached prefix never contributed to the output.

Fix: `o_tensor = tmp_output` after the merge.

This program: the function in plain torch with LightLLM's infer-state fields
(`cu_seqlens_q`, `cu_seqlens_k`, `b_ready_cache_len`, `cu_seqlens_prefix_k`,
`req_to_token_indexs`). `flash_attn_varlen_func` (returning the LSE) and
`merge_state_v2` are replaced by torch ports that call
`F.scaled_dot_product_attention`; the MLA decompression (`_decompress_kv`) is
reduced to gathering per-token K/V from the token cache. Two requests with 6
and 4 cached prefix tokens, each prefilling 3 new tokens.
"""
import sys
import types

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, return_softmax_lse=True):
    """Torch port of flash_attn varlen forward; lse is (nheads, total_q)."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.empty(q.shape[1], q.shape[0])
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qh, kh, vh = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        q_len, k_len = qe - qs, ke - ks
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len) if causal else None
        out[qs:qe] = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
        scores = (qh @ kh.transpose(-1, -2)) * softmax_scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse[:, qs:qe] = torch.logsumexp(scores, dim=-1)
    return out, lse


def merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged):
    """Merge two partial attention results given their log-sum-exp (shape [tokens, heads])."""
    s_max = torch.maximum(s_a, s_b)
    w_a = torch.exp(s_a - s_max)
    w_b = torch.exp(s_b - s_max)
    v_merged.copy_((v_a * w_a.unsqueeze(-1) + v_b * w_b.unsqueeze(-1)) / (w_a + w_b).unsqueeze(-1))
    s_merged.copy_(s_max + torch.log(w_a + w_b))


class Deepseek2TransformerLayerInfer:
    def __init__(self, head_num, qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
        self.tp_q_head_num_ = self.tp_k_head_num_ = self.tp_v_head_num_ = head_num
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.softmax_scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5

    def alloc_tensor(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def _decompress_kv(self, kv, infer_state, lens, starts_in_req):
        """Gather k_nope, k_rope, v for `lens[i]` tokens of each request starting at `starts_in_req[i]`."""
        idx = torch.cat([
            infer_state.req_to_token_indexs[r, s:s + n]
            for r, s, n in zip(infer_state.b_req_idx.tolist(), starts_in_req, lens.tolist())
        ]).long()
        k_nope, k_rope, v = kv
        return k_nope[idx], k_rope[idx], v[idx]

    def _context_attention_flashattention_kernel_with_CC(self, q, kv, infer_state, out=None):
        new_lens = infer_state.b_seq_len - infer_state.b_ready_cache_len
        k_nope, k_rope, v = self._decompress_kv(kv, infer_state, new_lens, infer_state.b_ready_cache_len.tolist())
        k = torch.cat([k_nope, torch.repeat_interleave(k_rope, self.tp_q_head_num_, dim=-2)], dim=-1)
        o_tensor, lse = flash_attn_varlen_func(
            q=q.view(-1, self.tp_q_head_num_, self.qk_nope_head_dim + self.qk_rope_head_dim),
            k=k.view(-1, self.tp_k_head_num_, self.qk_nope_head_dim + self.qk_rope_head_dim),
            v=v.view(-1, self.tp_v_head_num_, self.v_head_dim),
            cu_seqlens_q=infer_state.cu_seqlens_q,
            cu_seqlens_k=infer_state.cu_seqlens_k,
            max_seqlen_q=infer_state.q_max_seq_len,
            max_seqlen_k=infer_state.max_seq_len,
            softmax_scale=self.softmax_scale,
            causal=True,
            return_softmax_lse=True,
        )
        if infer_state.has_prefix_kv:
            k_nope, k_rope, v = self._decompress_kv(kv, infer_state, infer_state.b_ready_cache_len,
                                                    [0] * infer_state.batch_size)
            k = torch.cat([k_nope, torch.repeat_interleave(k_rope, self.tp_q_head_num_, dim=-2)], dim=-1)
            prefix_output, prefix_lse = flash_attn_varlen_func(
                q=q.view(-1, self.tp_q_head_num_, self.qk_nope_head_dim + self.qk_rope_head_dim),
                k=k.view(-1, self.tp_k_head_num_, self.qk_nope_head_dim + self.qk_rope_head_dim),
                v=v.view(-1, self.tp_v_head_num_, self.v_head_dim),
                cu_seqlens_q=infer_state.cu_seqlens_q,
                cu_seqlens_k=infer_state.cu_seqlens_prefix_k,
                max_seqlen_q=infer_state.q_max_seq_len,
                max_seqlen_k=infer_state.prefix_k_max_len,
                softmax_scale=self.softmax_scale,
                causal=False,
                return_softmax_lse=True,
            )
            lse = torch.transpose(lse, 0, 1).contiguous()
            prefix_lse = torch.transpose(prefix_lse, 0, 1).contiguous()
            tmp_output = (
                self.alloc_tensor((q.shape[0], q.shape[1], self.v_head_dim), dtype=q.dtype) if out is None else out
            )
            tmp_lse = torch.empty_like(lse)
            merge_state_v2(prefix_output, prefix_lse, o_tensor, lse, tmp_output, tmp_lse)
            if FIXED:
                o_tensor = tmp_output
        return o_tensor


def main():
    torch.manual_seed(0)
    heads, nope, rope, vdim = 4, 12, 4, 16
    layer = Deepseek2TransformerLayerInfer(heads, nope, rope, vdim)

    # Token-level KV buffer (already decompressed per token) and the request -> token table.
    total_tokens = 24
    kv = (torch.randn(total_tokens, heads, nope), torch.randn(total_tokens, 1, rope), torch.randn(total_tokens, heads, vdim))
    req_to_token_indexs = torch.zeros(2, 12, dtype=torch.int32)
    req_to_token_indexs[0, :9] = torch.tensor([3, 4, 5, 6, 7, 8, 20, 21, 22])   # 6 cached + 3 new
    req_to_token_indexs[1, :7] = torch.tensor([10, 11, 12, 13, 14, 15, 16])     # 4 cached + 3 new

    b_seq_len = torch.tensor([9, 7])
    b_ready_cache_len = torch.tensor([6, 4])
    new = b_seq_len - b_ready_cache_len
    infer_state = types.SimpleNamespace(
        batch_size=2,
        b_req_idx=torch.tensor([0, 1]),
        req_to_token_indexs=req_to_token_indexs,
        b_seq_len=b_seq_len,
        b_ready_cache_len=b_ready_cache_len,
        has_prefix_kv=True,
        cu_seqlens_q=F.pad(new.cumsum(0), (1, 0)),
        cu_seqlens_k=F.pad(new.cumsum(0), (1, 0)),
        q_max_seq_len=int(new.max()),
        max_seq_len=int(new.max()),
        cu_seqlens_prefix_k=F.pad(b_ready_cache_len.cumsum(0), (1, 0)),
        prefix_k_max_len=int(b_ready_cache_len.max()),
    )
    q = torch.randn(int(new.sum()), heads, nope + rope)
    o = layer._context_attention_flashattention_kernel_with_CC(q, kv, infer_state)
    print("fixed" if FIXED else "buggy", "prefill attention checksum:", round(o.sum().item(), 4))


if __name__ == "__main__":
    main()
