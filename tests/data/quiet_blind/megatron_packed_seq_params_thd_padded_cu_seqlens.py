"""Megatron-core THD packing: masks carried in a PackedSeqParams dataclass, no mask tensor at all.

Follows NVIDIA/Megatron-LM megatron/core/packed_seq_params.py (PackedSeqParams with qkv_format='thd',
cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, max_seqlen_q) and the way TEDotProductAttention
forwards it with attention_mask=None and attn_mask_type=AttnMaskType.causal. Each sequence in the pack
is padded to a multiple of 4 (as for context parallelism); cu_seqlens gives the real lengths and
cu_seqlens_q_padded gives where each sequence starts in the packed buffer.

Mask meant: causal inside each real sequence of the pack; nothing across sequences; the padding slots
between sequences are neither queries that matter nor keys anybody sees (their outputs are zeroed,
like TE's thd kernels leave them).
"""
import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

torch.manual_seed(0)


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4


@dataclass
class PackedSeqParams:
    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None


class DotProductAttention(torch.nn.Module):
    """Stands in for TEDotProductAttention: thd layout, masks from packed_seq_params."""

    def __init__(self, attn_mask_type):
        super().__init__()
        self.attn_mask_type = attn_mask_type

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None):
        # query: [t, h, d]; with thd packing the mask is implied by cu_seqlens, so attention_mask is None
        assert attention_mask is None and packed_seq_params.qkv_format == "thd"
        mask_type = attn_mask_type or self.attn_mask_type
        p = packed_seq_params
        out = torch.zeros_like(query)
        for i in range(len(p.cu_seqlens_q) - 1):
            start = p.cu_seqlens_q_padded[i].item()
            n = (p.cu_seqlens_q[i + 1] - p.cu_seqlens_q[i]).item()
            q = query[start:start + n].transpose(0, 1)
            k = key[start:start + n].transpose(0, 1)
            v = value[start:start + n].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=mask_type == AttnMaskType.causal)
            out[start:start + n] = o.transpose(0, 1)
        return out


def pack(seq_lens, divisible_by):
    padded = [(n + divisible_by - 1) // divisible_by * divisible_by for n in seq_lens]
    cu = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_padded = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0).to(torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    ), padded


def main():
    seq_lens = [5, 7, 3]
    heads, dim = 2, 8
    params, padded = pack(seq_lens, divisible_by=4)
    total = sum(padded)
    q, k, v = torch.randn(3, total, heads, dim).unbind(0)
    attn = DotProductAttention(AttnMaskType.causal)
    out = attn(q, k, v, attention_mask=None, packed_seq_params=params)

    for i, n in enumerate(seq_lens):
        s = params.cu_seqlens_q_padded[i].item()
        ref = F.scaled_dot_product_attention(
            q[s:s + n].transpose(0, 1), k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        assert torch.allclose(out[s:s + n], ref, atol=1e-6)
        assert out[s + n:s + padded[i]].abs().sum() == 0
    print("packed", seq_lens, "into", total, "slots; cu_seqlens", params.cu_seqlens_q.tolist(), "padded", params.cu_seqlens_q_padded.tolist())


if __name__ == "__main__":
    main()
