# meta-recsys/generative-recommenders commit 2b402a7 (D66035477): RaggedAttentionFunction.forward did
# `contextual_seq_len = 0 if contextual_seq_len else contextual_seq_len`, so any positive contextual length became 0
# and the contextual (user-feature) prefix lost its full attention; fixed to `... if contextual_seq_len is None ...`.
# The Triton kernel is replaced by the project's PyTorch reference (`_get_valid_attn_mask` + silu attention) on CPU.
import sys
from typing import Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _get_valid_attn_mask(device, causal: bool, N: int, seq_lengths: torch.Tensor,
                         num_targets: Optional[torch.Tensor] = None, max_attn_len: int = 0,
                         contextual_seq_len: int = 0) -> torch.Tensor:
    ids = torch.arange(0, N, device=device).view(1, N)
    max_ids = seq_lengths.view(-1, 1, 1)
    if contextual_seq_len > 0:
        ids = ids - contextual_seq_len + 1
        ids = torch.clamp(ids, min=0)
        max_ids = max_ids - contextual_seq_len + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.view(-1, 1, 1)
        ids = torch.clamp(ids, max=max_ids)
        row_ids = ids.view(-1, N, 1).expand(-1, N, N)
        col_ids = ids.view(-1, 1, N).expand(-1, N, N)
    else:
        row_ids = ids.view(N, 1).expand(N, N)
        col_ids = row_ids.t()
        row_ids = row_ids.view(1, N, N)
        col_ids = col_ids.view(1, N, N)
    row_col_dist = row_ids - col_ids
    valid_attn_mask = torch.eye(N, device=device, dtype=torch.bool).view(1, N, N)
    if not causal:
        row_col_dist = torch.where(row_col_dist > 0, row_col_dist, -row_col_dist)
    valid_attn_mask = torch.logical_or(valid_attn_mask, row_col_dist > 0)
    if max_attn_len > 0:
        valid_attn_mask = torch.logical_and(valid_attn_mask, row_col_dist <= max_attn_len)
    if contextual_seq_len > 0:
        valid_attn_mask = torch.logical_or(valid_attn_mask, torch.logical_and(row_ids == 0, col_ids < max_ids))
    return valid_attn_mask


def ragged_attention_fwd(N, alpha, q, k, v, seq_offsets, num_targets, max_attn_len, contextual_seq_len):
    """Dense stand-in for triton_ragged_attention_fwd: HSTU pointwise (silu) attention on padded [B, H, N, D]."""
    B = seq_offsets.numel() - 1
    seq_lengths = seq_offsets[1:] - seq_offsets[:-1]
    pad = lambda x: torch.stack([F.pad(x[seq_offsets[b]:seq_offsets[b + 1]], (0, 0, 0, 0, 0, N - seq_lengths[b]))
                                 for b in range(B)]).transpose(1, 2)
    pq, pk, pv = pad(q), pad(k), pad(v)
    qk_attn = torch.einsum("bhxa,bhya->bhxy", pq, pk) * alpha
    qk_attn = F.silu(qk_attn) / N
    valid_attn_mask = _get_valid_attn_mask(q.device, True, N, seq_lengths, num_targets, max_attn_len,
                                           contextual_seq_len)
    qk_attn = qk_attn * valid_attn_mask.unsqueeze(1)
    out = torch.einsum("bhxd,bhdv->bhxv", qk_attn, pv).transpose(1, 2)  # [B, N, H, V]
    return torch.cat([out[b, :seq_lengths[b]] for b in range(B)])


class RaggedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, N, alpha, q, k, v, seq_offsets, num_targets, max_attn_len, contextual_seq_len):
        if FIXED:
            contextual_seq_len = 0 if contextual_seq_len is None else contextual_seq_len
        else:
            contextual_seq_len = 0 if contextual_seq_len else contextual_seq_len
        max_attn_len = max_attn_len or 0
        ctx.contextual_seq_len = contextual_seq_len
        return ragged_attention_fwd(N, alpha, q, k, v, seq_offsets, num_targets, max_attn_len, contextual_seq_len)


# Two users; each jagged sequence = 3 contextual (user-feature) tokens + UIH items + 1 target candidate.
H, D, contextual_seq_len = 2, 8, 3
seq_offsets = torch.tensor([0, 9, 16])
num_targets = torch.tensor([1, 1])
L, N = int(seq_offsets[-1]), 9
q, k, v = (torch.randn(L, H, D) for _ in range(3))

out = RaggedAttentionFunction.apply(N, 1.0 / D ** 0.5, q, k, v, seq_offsets, num_targets, None, contextual_seq_len)
ref = ragged_attention_fwd(N, 1.0 / D ** 0.5, q, k, v, seq_offsets, num_targets, 0, contextual_seq_len)
print(f"fixed={FIXED}: contextual_seq_len={contextual_seq_len}, max |out - reference with contextual mask| = "
      f"{(out - ref).abs().max().item():.3e}")
