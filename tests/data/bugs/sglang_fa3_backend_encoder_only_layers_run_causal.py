"""SGLang FlashAttention backend: encoder-only (embedding) layers are run with a causal mask.

Citation: sgl-project/sglang PR #10172 ("[bugfix]: use correct causality condition for flashattention,
flashinfer, and triton backends"; first opened as #8534). Description read: non-causal attention is
needed for encoder-only and cross-attention layers, and these backends each checked only one of the
two conditions. The pre-fix line of `FlashAttentionBackend.forward_extend`,
`causal = not layer.is_cross_attention`, is read from older copies of
`python/sglang/srt/layers/attention/flashattention_backend.py`; the fixed form
(`causal = True; if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY: causal = False`)
from later ones.

Bug: for a bidirectional embedding model (BERT-like, `RadixAttention(attn_type=ENCODER_ONLY)`) served with
the FA3 backend, the extend pass computed causality from `is_cross_attention` alone, so every token of
every request only attended to earlier tokens: embeddings silently became those of a causal model.

Fix: treat `AttentionType.ENCODER_ONLY` as non-causal too.

Reproduction: two requests (5 and 3 tokens) packed in one extend batch with `cu_seqlens_q`; the
`flash_attn_varlen_func` call is replaced by a CPU reference that runs `F.scaled_dot_product_attention`
per request with `is_causal=causal` (flash-attn's varlen semantics for q_len == k_len).
"""
import sys
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class AttentionType(Enum):
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


@dataclass
class RadixAttention:
    num_heads: int
    head_dim: int
    scaling: float
    num_kv_heads: int
    layer_id: int
    is_cross_attention: bool = False
    attn_type: AttentionType = AttentionType.DECODER

    @property
    def tp_q_head_num(self):
        return self.num_heads


@dataclass
class ForwardMetadata:
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seq_len_q: int
    max_seq_len_k: int


@dataclass
class ForwardBatch:
    extend_seq_lens: torch.Tensor


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """CPU reference for the varlen kernel (q_len == k_len per request here)."""
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        s, e = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        out[s:e] = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
            is_causal=causal, scale=softmax_scale).transpose(0, 1)
    return out


class FlashAttentionBackend:
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        cu = torch.nn.functional.pad(torch.cumsum(forward_batch.extend_seq_lens, 0, dtype=torch.int32), (1, 0))
        max_len = int(forward_batch.extend_seq_lens.max())
        self.forward_metadata = ForwardMetadata(cu, cu, max_len, max_len)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        metadata = self.forward_metadata
        if FIXED:
            causal = True
            if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
                causal = False
        else:
            causal = not layer.is_cross_attention
        q_ = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        k_ = k.view(-1, layer.num_kv_heads, layer.head_dim)
        v_ = v.view(-1, layer.num_kv_heads, layer.head_dim)
        o = flash_attn_varlen_func(q_, k_, v_, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                                   metadata.max_seq_len_q, metadata.max_seq_len_k, layer.scaling, causal)
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)


class BertSelfAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_heads, layer_id):
        super().__init__()
        head_dim = hidden_size // num_heads
        self.qkv_proj = torch.nn.Linear(hidden_size, 3 * hidden_size)
        self.attn = RadixAttention(num_heads, head_dim, head_dim ** -0.5, num_heads, layer_id,
                                   attn_type=AttentionType.ENCODER_ONLY)

    def forward(self, hidden_states, forward_batch, backend):
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        return backend.forward_extend(q, k, v, self.attn, forward_batch, save_kv_cache=False)


def main():
    hidden_size, num_heads, vocab = 32, 4, 64
    embed = torch.nn.Embedding(vocab, hidden_size)
    layer = BertSelfAttention(hidden_size, num_heads, layer_id=0)
    backend = FlashAttentionBackend()
    seq_lens = [5, 3]
    input_ids = torch.randint(0, vocab, (sum(seq_lens),))
    forward_batch = ForwardBatch(extend_seq_lens=torch.tensor(seq_lens))
    backend.init_forward_metadata(forward_batch)
    with torch.no_grad():
        out = layer(embed(input_ids), forward_batch, backend)
        # CLS pooling, as the embedding server returns it
        starts = [0, seq_lens[0]]
        pooled = F.normalize(out[starts], dim=-1)
    print("embedding similarity", round(float(pooled[0] @ pooled[1]), 4))


if __name__ == "__main__":
    main()
