"""Packed pre-training batch: several documents concatenated in one row, causal within each document only.

Follows pytorch-labs/attention-gym (attn_gym/masks/document_mask.py: generate_doc_mask_mod, _offsets_to_doc_ids_tensor)
and the flash-attn varlen convention of cu_seqlens (cumulative document offsets) used by packing collators
such as HF DataCollatorWithFlattening. position_ids restart at 0 at each document start. Mask meant:
block-diagonal causal; a token never sees an earlier document packed before it.
"""
import warnings

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def _offsets_to_doc_ids_tensor(offsets):
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_doc_mask_mod(mask_mod, offsets):
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        return same_doc & mask_mod(b, h, q_logical, kv_logical)

    return doc_mask_mod


def main():
    # eager flex_attention on CPU (no torch.compile in a short test run) warns once about the unfused path
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)
    n_heads, head_dim, dim = 2, 16, 32
    seq_lens = [50, 30, 20, 28]                    # documents packed by the collator
    cu_seqlens = torch.tensor([0] + seq_lens).cumsum(0)
    total = int(cu_seqlens[-1])
    position_ids = torch.cat([torch.arange(n) for n in seq_lens])

    x = torch.randn(1, total, dim) + 0.01 * position_ids[None, :, None]
    qkv = nn.Linear(dim, 3 * dim).requires_grad_(False)   # inference; flex_attention has no CPU backward
    q, k, v = qkv(x).view(1, total, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4)

    block_mask = create_block_mask(generate_doc_mask_mod(causal_mask, cu_seqlens), B=None, H=None,
                                   Q_LEN=total, KV_LEN=total, device="cpu")
    out = flex_attention(q, k, v, block_mask=block_mask)
    print("out", tuple(out.shape), "documents", len(seq_lens))


if __name__ == "__main__":
    main()
