"""torch.nn.MultiheadAttention: an inverted attn_mask and a key_padding_mask, True = masked.

Documented rule (PyTorch MultiheadAttention.forward): a bool attn_mask (L, S) or
(B * num_heads, L, S) where "True indicates that the corresponding position is not allowed
to attend"; key_padding_mask (B, S), "True ... will be ignored for the purpose of attention".
Both are the opposite polarity of SDPA's. A row with every key masked gives NaN.
"""

from __future__ import annotations

import numpy as np

from maskcli.formats.base import Export, dense_cells

NAME = "mha"


def to(mask) -> Export:
    keep = dense_cells(mask, 1, "nn.MultiheadAttention")  # (B, H', Lq, Lk)
    batch, heads = keep.shape[:2]
    tensors = {}
    args = []
    if heads == 1:
        seen_by_row = keep[:, 0].any(axis=1)  # (B, Lk): keys some query of the row sees
        shared = keep[:, 0].any(axis=0)  # (Lq, Lk): what any batch row allows
        if np.array_equal(keep[:, 0], shared[None] & seen_by_row[:, None, :]):
            tensors["attn_mask"] = ~shared
            if not seen_by_row.all():
                tensors["key_padding_mask"] = ~seen_by_row
    if not tensors:  # batch rows (or heads) differ beyond key padding: one mask per (batch, head)
        per_head = np.broadcast_to(keep, (batch, mask.heads) + keep.shape[2:]).reshape((-1,) + keep.shape[2:])
        tensors["attn_mask"] = ~per_head
    args = ", ".join(f"{name}=<{name}>" for name in tensors)
    code = ["import torch",
            f"mha = torch.nn.MultiheadAttention(embed_dim, num_heads={mask.heads}, batch_first=True, device=query.device)",
            f"out, weights = mha(query, key, value, {args})  # query: (B, Lq, E), key and value: (B, Lk, E)"]
    notes = ["True = masked in both attn_mask and key_padding_mask (the opposite of SDPA's bool mask)"]
    if tensors["attn_mask"].ndim == 3:
        notes.append(f"attn_mask is (B * num_heads, Lq, Lk): batch rows differ beyond key padding; num_heads must be {mask.heads}")
    if not keep.any(-1).all():
        notes.append("some query rows see no key: MultiheadAttention gives NaN there")
    return Export(code, tensors, notes, device="query.device")
