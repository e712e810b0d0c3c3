"""diffusers FA3 varlen backend packs the first ``mask.sum()`` keys instead of the keys the mask keeps.

Citation: huggingface/diffusers#14115 (commit 5be68ced49, "fix `_flash_3_varlen_hub` mask handling",
with a QwenImage transformer test); diff read upstream.

Bug: ``_flash_attention_3_varlen_hub`` normalised the boolean ``attn_mask`` to ``[batch, seq_len_kv]``,
derived ``seqlens_k = attn_mask.sum(1)`` and then packed ``key[b, :valid_len]`` for every sample, i.e. it
assumed the kept keys are a prefix. QwenImage's joint attention runs over [text, image] with the mask
``cat([encoder_hidden_states_mask, ones(image)])``: the kept keys are the real text tokens *and* all image
tokens, with the text padding in between. The prefix slice therefore packs the text padding and drops the
last image tokens.
Fix: pack the keys at ``attn_mask.flatten().nonzero()`` (``key.reshape(-1, ...)[indices_k]``), and use
the no-mask path (full lengths) when there is no mask.

This program keeps the backend function as it was and one QwenImage-style double-stream joint attention
(text first, then image) that builds the mask. The hub FA3 kernel (CUDA only) is replaced by a CPU
stand-in with the same ``q, k, v, cu_seqlens_q, cu_seqlens_k`` contract that runs
``F.scaled_dot_product_attention`` on each packed sequence. Two prompts of 2 and 5 real tokens (padded to
6) over 4 image tokens.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False):
    """CPU stand-in for the hub FA3 varlen kernel: packed (total, heads, dim) tensors, one sequence each."""
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
            scale=softmax_scale, is_causal=causal,
        )
        out[qs:qe] = o.transpose(0, 1)
    return out


def _prepare_for_flash_attn_or_sage_varlen_without_mask(batch_size, seq_len_q, seq_len_kv, device=None):
    seqlens_q = torch.full((batch_size,), seq_len_q, dtype=torch.int32, device=device)
    seqlens_k = torch.full((batch_size,), seq_len_kv, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
    cu_seqlens_k = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = torch.cumsum(seqlens_q, dim=0)
    cu_seqlens_k[1:] = torch.cumsum(seqlens_k, dim=0)
    return (seqlens_q, seqlens_k), (cu_seqlens_q, cu_seqlens_k), (seqlens_q.max().item(), seqlens_k.max().item())


def _prepare_for_flash_attn_or_sage_varlen_with_mask(batch_size, seq_len_q, attn_mask, device=None):
    seqlens_q = torch.full((batch_size,), seq_len_q, dtype=torch.int32, device=device)
    seqlens_k = attn_mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens_q = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
    cu_seqlens_k = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = torch.cumsum(seqlens_q, dim=0)
    cu_seqlens_k[1:] = torch.cumsum(seqlens_k, dim=0)
    return (seqlens_q, seqlens_k), (cu_seqlens_q, cu_seqlens_k), (seqlens_q.max().item(), seqlens_k.max().item())


def _prepare_for_flash_attn_or_sage_varlen(batch_size, seq_len_q, seq_len_kv, attn_mask=None, device=None):
    if attn_mask is None:
        return _prepare_for_flash_attn_or_sage_varlen_without_mask(batch_size, seq_len_q, seq_len_kv, device)
    return _prepare_for_flash_attn_or_sage_varlen_with_mask(batch_size, seq_len_q, attn_mask, device)


def _normalize_attn_mask(attn_mask, batch_size, seq_len_k):
    """Normalize a [batch, 1, 1, seq_len_k] or [batch, seq_len_k] boolean mask to [batch, seq_len_k]."""
    if attn_mask.dtype != torch.bool:
        raise ValueError(f"Attention mask must be of type bool, got {attn_mask.dtype}.")
    if attn_mask.ndim == 4:
        attn_mask = attn_mask.reshape(attn_mask.shape[0], attn_mask.shape[-1])
    return attn_mask.expand(batch_size, seq_len_k)


def _flash_attention_3_varlen_hub(query, key, value, attn_mask=None, scale=None, is_causal=False):
    batch_size, seq_len_q, _, _ = query.shape
    _, seq_len_kv, _, _ = key.shape

    if FIXED:
        if attn_mask is not None:
            attn_mask = _normalize_attn_mask(attn_mask, batch_size, seq_len_kv)
            (_, _), (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k) = (
                _prepare_for_flash_attn_or_sage_varlen_with_mask(batch_size, seq_len_q, attn_mask, query.device)
            )
            indices_k = attn_mask.flatten().nonzero(as_tuple=False).flatten()
            key_packed = key.reshape(-1, *key.shape[2:])[indices_k]
            value_packed = value.reshape(-1, *value.shape[2:])[indices_k]
        else:
            (_, _), (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k) = (
                _prepare_for_flash_attn_or_sage_varlen_without_mask(batch_size, seq_len_q, seq_len_kv, query.device)
            )
            key_packed = key.flatten(0, 1)
            value_packed = value.flatten(0, 1)
    else:
        if attn_mask is not None:
            attn_mask = _normalize_attn_mask(attn_mask, batch_size, seq_len_kv)

        (_, seqlens_k), (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k) = (
            _prepare_for_flash_attn_or_sage_varlen(
                batch_size, seq_len_q, seq_len_kv, attn_mask=attn_mask, device=query.device
            )
        )

        key_valid, value_valid = [], []
        for b in range(batch_size):
            valid_len = seqlens_k[b]
            key_valid.append(key[b, :valid_len])
            value_valid.append(value[b, :valid_len])
        key_packed = torch.cat(key_valid, dim=0)
        value_packed = torch.cat(value_valid, dim=0)

    query_packed = query.flatten(0, 1)

    out = flash_attn_varlen_func(
        q=query_packed, k=key_packed, v=value_packed,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        softmax_scale=scale, causal=is_causal,
    )
    return out.unflatten(0, (batch_size, -1))


class QwenDoubleStreamAttention(nn.Module):
    """Joint [text, image] attention as QwenDoubleStreamAttnProcessor2_0 lays it out (B, S, H, D)."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.add_qkv_proj = nn.Linear(dim, 3 * dim)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask):
        img_q, img_k, img_v = self.to_qkv(hidden_states).unflatten(-1, (3, self.heads, -1)).unbind(2)
        txt_q, txt_k, txt_v = self.add_qkv_proj(encoder_hidden_states).unflatten(-1, (3, self.heads, -1)).unbind(2)

        # Concatenate for joint attention, order: [text, image]
        joint_query = torch.cat([txt_q, img_q], dim=1)
        joint_key = torch.cat([txt_k, img_k], dim=1)
        joint_value = torch.cat([txt_v, img_v], dim=1)

        batch_size, image_seq_len = hidden_states.shape[:2]
        image_mask = torch.ones((batch_size, image_seq_len), dtype=torch.bool)
        joint_attention_mask = torch.cat([encoder_hidden_states_mask.bool(), image_mask], dim=1)
        joint_attention_mask = joint_attention_mask[:, None, None, :]

        joint_hidden_states = _flash_attention_3_varlen_hub(joint_query, joint_key, joint_value,
                                                            attn_mask=joint_attention_mask)
        return joint_hidden_states.flatten(2, 3)


def main():
    torch.manual_seed(0)
    attn = QwenDoubleStreamAttention().eval()
    hidden_states = torch.randn(2, 4, 16)          # image tokens
    encoder_hidden_states = torch.randn(2, 6, 16)  # text tokens, right padded
    encoder_hidden_states_mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    with torch.no_grad():
        out = attn(hidden_states, encoder_hidden_states, encoder_hidden_states_mask)
    print("joint out", tuple(out.shape), "image token 0 of sample 0", [round(v, 4) for v in out[0, 6, :3].tolist()])


if __name__ == "__main__":
    main()
