"""Packed SFT batch whose attention_mask holds sample numbers, as LLaMA-Factory's block_diag_attn packing does.

Follows hiyouga/LLaMA-Factory src/llamafactory/model/model_utils/packing.py (get_seqlens_in_batch,
get_unpad_data) and src/llamafactory/data/collator.py (prepare_4d_attention_mask). The packed dataset writes the
attention_mask as [1, 1, 2, 2, 2, 0]: value k marks the k-th sample of the row, 0 is padding. Two equivalent
attention paths are run: the flash-attn varlen path (cu_seqlens from get_unpad_data; emulated with one causal SDPA
call per sample) and the eager/SDPA path (4-D mask: same sample number, not padding, causal). Tokens of one
sample never see another sample of the same row; padding rows get a fully masked row of finfo.min (unused).
"""
import torch
import torch.nn.functional as F


def get_seqlens_in_batch(attention_mask):
    bsz = attention_mask.size(0)
    max_num = torch.max(attention_mask).item()
    counts = torch.zeros((bsz, max_num), dtype=attention_mask.dtype)
    for i in range(max_num):  # one pass per sample number, not per token
        counts[:, i] = torch.sum(attention_mask == (i + 1), dim=-1)
    counts = counts.flatten()
    return counts[counts.nonzero().squeeze(dim=-1)]


def get_unpad_data(attention_mask):
    seqlens_in_batch = get_seqlens_in_batch(attention_mask)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def prepare_4d_attention_mask(attention_mask_with_indices, dtype):
    """[B, S] sample numbers -> [B, 1, S, S] additive mask (0 where allowed, finfo.min elsewhere)."""
    _, seq_len = attention_mask_with_indices.size()
    min_dtype = torch.finfo(dtype).min
    zero_tensor = torch.tensor(0, dtype=dtype)
    non_padding_mask = (attention_mask_with_indices != 0).unsqueeze(1).unsqueeze(2)
    indices = attention_mask_with_indices.unsqueeze(1).unsqueeze(2)
    indices_t = attention_mask_with_indices.unsqueeze(1).unsqueeze(3)
    tril_mask = torch.tril(torch.ones((seq_len, seq_len), dtype=torch.bool))
    attention_mask_4d = (indices == indices_t) & non_padding_mask & tril_mask
    return torch.where(attention_mask_4d, zero_tensor, min_dtype)


def flash_attn_varlen_func_reference(q, k, v, cu_seqlens, max_seqlen):
    """What flash_attn_varlen_func(causal=True) computes: causal attention inside each [start, end) span."""
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        assert end - start <= max_seqlen
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


def main():
    torch.manual_seed(0)
    attention_mask = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
    B, S, H, D = 2, 6, 2, 8
    q, k, v = (torch.randn(B, S, H, D) for _ in range(3))
    indices, cu_seqlens, max_seqlen = get_unpad_data(attention_mask)
    assert cu_seqlens.tolist() == [0, 2, 5, 6, 8, 11] and max_seqlen == 3
    unpad = lambda t: t.reshape(B * S, H, D).index_select(0, indices)
    varlen_out = flash_attn_varlen_func_reference(unpad(q), unpad(k), unpad(v), cu_seqlens, max_seqlen)
    mask_4d = prepare_4d_attention_mask(attention_mask, torch.float32)
    sdpa_out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask_4d).transpose(1, 2)
    assert torch.allclose(sdpa_out.reshape(B * S, H, D)[indices], varlen_out, atol=1e-5)
    print(f"samples {len(cu_seqlens) - 1} tokens {len(indices)}")


if __name__ == "__main__":
    main()
