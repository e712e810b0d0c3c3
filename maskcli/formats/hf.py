"""Hugging Face transformers: a 4-D (B, 1, Lq, Lk) float mask, 0 = attend, finfo(dtype).min = masked, and
position_ids that restart in each packed document.

Documented rule (transformers "custom 4D attention mask"; masking_utils): a 4-D
attention_mask is used as given, in the eager convention: added to the scores, 0 where a
query may attend and torch.finfo(dtype).min where not, in the model's dtype (float32's min
overflows to -inf in bfloat16 and float16: clamp before casting). Packed sequences need
position_ids that restart at 0 in each document, or the rotary positions run on across them.
"""

from __future__ import annotations

import numpy as np

from maskcli.formats.base import Export, dense_cells

NAME = "hf"


def position_ids(mask) -> np.ndarray | None:
    """(B, Lq) positions within each document, from the expression's document or segment labels; None without."""
    from maskcli.kinds.labels import run_starts
    from maskcli.terms import terms

    tree = mask.expression
    if tree is None:
        return None
    found = [term for term in terms(tree) if term.kind.documents]
    if not found:
        return None
    labels = next(value for _, value in found[0].params if hasattr(value, "array")).array
    q = mask.frame.q_positions()
    positions = (q[None, :] - run_starts(labels)[:, q]).astype(np.int64)
    return np.ascontiguousarray(np.broadcast_to(positions, (mask.batch, q.size)))


def to(mask) -> Export:
    keep = dense_cells(mask, 4, "Hugging Face")
    keep = keep[:, :1] if not mask.heads_differ else keep
    keep = np.broadcast_to(keep, (mask.batch,) + keep.shape[1:])
    tensors = {"attention_mask": np.where(keep, np.float32(0), np.finfo(np.float32).min).astype(np.float32)}
    args = "attention_mask=<attention_mask>.clamp(min=torch.finfo(model.dtype).min).to(model.dtype)"
    positions = position_ids(mask)
    if positions is not None:
        tensors["position_ids"] = positions
        args += ", position_ids=<position_ids>"
    code = ["import torch", f"out = model(input_ids, {args})  # input_ids: (B, Lq)"]
    notes = ["4-D mask: 0 = attend, finfo(dtype).min = masked, added to the scores (eager); cast it to the model's dtype",
             "float32's min is -inf in bfloat16 and float16: clamp to the model dtype's min before casting, as the call does"]
    if positions is not None:
        notes.append("position_ids restart at 0 in each document: without them packed documents get the positions of one long sequence")
    return Export(code, tensors, notes, device="cpu")
