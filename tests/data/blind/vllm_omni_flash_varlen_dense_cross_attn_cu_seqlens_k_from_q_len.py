"""vLLM-Omni diffusion FLASH_ATTN: the dense varlen path gave the keys the query's cu_seqlens.

Citation: vllm-project/vllm-omni#3525 ("[XPU] set flash_attn as default diffusion attn backend
and fix k_len for cross_attn", merged); `FlashAttentionImpl._forward_varlen_dense` in
`vllm_omni/diffusion/attention/backends/flash_attn.py` read before and after the PR, the
Wan cross-attention (`WanCrossAttention`, `WanTransformerBlock`) from
`vllm_omni/diffusion/models/wan2_2/wan2_2_transformer.py`.

Bug: `_forward_varlen_dense` (the path `forward_xpu` takes when there is no padding mask, and
`forward_cuda` when no dense `flash_attn_func` is importable) flattened q/k/v to (b s) and built
one `cu_seqlens = arange(0, (batch_size + 1) * q_len, step=q_len)`, passed as both
`cu_seqlens_q` and `cu_seqlens_k`, with `max_seqlen_k=q_len`.  Right for self-attention; in
cross-attention (Wan's attn2: image/video queries against the text context) key sequence i
is taken as rows [i*q_len, (i+1)*q_len) of the flattened text keys, so each sample attends
to a window of the wrong length, shifted into the neighbouring sample's prompt.
Fix: `k_len = key.size(1)`, separate `cu_seqlens_q` / `cu_seqlens_k` and `max_seqlen_k=k_len`.

Reproduction: FlashAttentionImpl's `forward_xpu` / `_forward_varlen_dense` as written, with a
CPU stand-in for the varlen kernel (per-sequence softmax attention over the cu_seqlens
slices, which is what the kernel computes); a one-block Wan transformer (self-attention,
text cross-attention, FFN, scale-shift modulation) over a batch of two prompts whose text
context is padded to a fixed length (no mask, as Wan does) and is longer than the latent
token sequence, so every slice stays inside the key buffer.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# --- stand-in for vllm's flash_attn_varlen_func (vllm/_xpu_ops.py / vllm_flash_attn) -----
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, softmax_scale=None):
    outs = []
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)  # h s d
        ki = k[ks:ke].transpose(0, 1)
        vi = v[ks:ke].transpose(0, 1)
        scores = (qi @ ki.transpose(-1, -2)) * softmax_scale
        if causal:  # bottom-right aligned, as flash-attn >= 2.1
            lq, lk = qe - qs, ke - ks
            keep = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
            scores = scores.masked_fill(~keep, float("-inf"))
        outs.append((scores.softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(outs, dim=0)


# --- vllm_omni/diffusion/attention/backends/abstract.py (trimmed) ------------------------
@dataclass
class AttentionMetadata:
    attn_mask: torch.Tensor | None = None


# --- vllm_omni/diffusion/attention/backends/flash_attn.py (trimmed) ----------------------
class FlashAttentionImpl:
    def __init__(self, num_heads, head_size, softmax_scale, causal=False, num_kv_heads=None, prefix=""):
        self.num_heads = num_heads
        self.causal = causal
        self.softmax_scale = softmax_scale

    @staticmethod
    def _unwrap_flash_output(out):
        # FA3 may return (out, lse), FA2 returns out
        return out[0] if isinstance(out, tuple) else out

    def _forward_varlen_dense(self, query, key, value):
        batch_size, q_len = query.size()[:2]
        if FIXED:
            k_len = key.size(1)
            cu_seqlens_q = torch.arange(0, (batch_size + 1) * q_len, step=q_len, dtype=torch.int32, device=query.device)
            cu_seqlens_k = torch.arange(0, (batch_size + 1) * k_len, step=k_len, dtype=torch.int32, device=query.device)
        else:
            cu_seqlens = torch.arange(0, (batch_size + 1) * q_len, step=q_len, dtype=torch.int32, device=query.device)
            cu_seqlens_q = cu_seqlens_k = cu_seqlens
            k_len = q_len
        # b s ... -> (b s) ...
        query = query.flatten(0, 1)
        key = key.flatten(0, 1)
        value = value.flatten(0, 1)

        out = flash_attn_varlen_func(
            q=query,
            k=key,
            v=value,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=q_len,
            max_seqlen_k=k_len,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
        )
        out = self._unwrap_flash_output(out)
        # (b s) h d -> b s h d
        return out.reshape(batch_size, q_len, *out.shape[1:])

    def forward_xpu(self, query, key, value, attn_metadata: AttentionMetadata = None):
        attention_mask = attn_metadata.attn_mask if attn_metadata is not None else None
        if attention_mask is not None and torch.any(~attention_mask):
            raise NotImplementedError("masked varlen path not used by Wan")
        return self._forward_varlen_dense(query, key, value)


# --- vllm_omni/diffusion/attention/layer.py: Attention (trimmed to the impl call) --------
class Attention(nn.Module):
    def __init__(self, num_heads, head_size, softmax_scale, causal=False):
        super().__init__()
        self.impl = FlashAttentionImpl(num_heads, head_size, softmax_scale, causal=causal)

    def forward(self, query, key, value, attn_metadata=None):
        return self.impl.forward_xpu(query, key, value, attn_metadata)


# --- vllm_omni/diffusion/models/wan2_2/wan2_2_transformer.py (trimmed) ------------------
class WanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, head_dim, eps=1e-6):
        super().__init__()
        self.num_heads = num_heads
        self.to_qkv = nn.Linear(dim, 3 * num_heads * head_dim, bias=True)
        self.norm_q = nn.RMSNorm(num_heads * head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(num_heads * head_dim, eps=eps)
        self.to_out = nn.Linear(num_heads * head_dim, dim, bias=True)
        self.attn = Attention(num_heads=num_heads, head_size=head_dim, softmax_scale=1.0 / (head_dim**0.5), causal=False)

    def forward(self, hidden_states):
        query, key, value = self.to_qkv(hidden_states).chunk(3, dim=-1)
        query, key = self.norm_q(query), self.norm_k(key)
        query, key, value = (t.unflatten(2, (self.num_heads, -1)) for t in (query, key, value))
        hidden_states = self.attn(query, key, value).flatten(2, 3).type_as(query)
        return self.to_out(hidden_states)


class WanCrossAttention(nn.Module):
    def __init__(self, dim, num_heads, head_dim, eps=1e-5):
        super().__init__()
        self.num_heads = num_heads
        self.inner_dim = num_heads * head_dim
        self.to_q = nn.Linear(dim, self.inner_dim, bias=True)
        self.to_k = nn.Linear(dim, self.inner_dim, bias=True)
        self.to_v = nn.Linear(dim, self.inner_dim, bias=True)
        self.norm_q = nn.RMSNorm(self.inner_dim, eps=eps)
        self.norm_k = nn.RMSNorm(self.inner_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, dim, bias=True), nn.Dropout(0.0)])
        self.attn = Attention(num_heads=num_heads, head_size=head_dim, softmax_scale=1.0 / (head_dim**0.5), causal=False)

    def forward(self, hidden_states, encoder_hidden_states):
        query = self.norm_q(self.to_q(hidden_states))
        key = self.norm_k(self.to_k(encoder_hidden_states))
        value = self.to_v(encoder_hidden_states)
        query = query.unflatten(2, (self.num_heads, -1))
        key = key.unflatten(2, (self.num_heads, -1))
        value = value.unflatten(2, (self.num_heads, -1))
        hidden_states = self.attn(query, key, value)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = self.to_out[0](hidden_states)
        return self.to_out[1](hidden_states)


class WanTransformerBlock(nn.Module):
    def __init__(self, dim, ffn_dim, num_heads, eps=1e-6):
        super().__init__()
        head_dim = dim // num_heads
        self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanSelfAttention(dim, num_heads, head_dim, eps=eps)
        self.attn2 = WanCrossAttention(dim, num_heads, head_dim, eps=eps)
        self.norm2 = nn.Identity()
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.norm3 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, hidden_states, encoder_hidden_states, temb):
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table + temb.float()
        ).chunk(6, dim=1)
        norm_hidden_states = (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
        attn_output = self.attn1(norm_hidden_states)
        hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
        norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states)
        hidden_states = hidden_states + attn_output
        norm_hidden_states = (self.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden_states)
        ff_output = self.ffn(norm_hidden_states)
        return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


def main():
    torch.manual_seed(0)
    dim, heads, text_len = 32, 2, 24
    block = WanTransformerBlock(dim, 64, heads).eval()
    text_embedder = nn.Linear(16, dim)

    # two prompts of 7 and 11 T5 tokens, zero-padded to the fixed text length (no mask)
    prompt_lens = [7, 11]
    t5 = torch.zeros(2, text_len, 16)
    for i, n in enumerate(prompt_lens):
        t5[i, :n] = torch.randn(n, 16)
    # 1 latent frame of 4 x 4 patches: 16 video tokens per sample
    latents = torch.randn(2, 16, dim)
    temb = torch.randn(2, 6, dim) * 0.1

    with torch.no_grad():
        encoder_hidden_states = text_embedder(t5)
        out = block(latents, encoder_hidden_states, temb)

    print("fixed" if FIXED else "buggy", "out[1, 0, :4]", [round(x, 5) for x in out[1, 0, :4].tolist()])


if __name__ == "__main__":
    main()
