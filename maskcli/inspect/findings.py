"""What looks wrong with a mask tensor: rows that see nothing, later keys a kind does not mean,
fills that overflow in float16/bfloat16, a 3-D mask whose first dimension is the head count."""

from __future__ import annotations

import numpy as np

from maskcli.checks.rows import given_empty_rows, given_later
from maskcli.conventions import FLOAT_MIN, rounded
from maskcli.inspect.polarity import Convention, sdpa_view, to_keep
from maskcli.inspect.structure import Structure
from maskcli.tensorfile import dtype_name
from maskcli.text import Finding


def findings(tensor: np.ndarray, convention: Convention, keep4: np.ndarray, structure: Structure,
             heads: int | None = None, q_offset: int = 0) -> list[Finding]:
    """Rows that see nothing, later keys a kind does not mean, fills that overflow, a 3-D heads trap, and more."""
    result = given_empty_rows(keep4, structure.reading, q_offset) + given_later(keep4, structure, q_offset)
    q_len, k_len = sdpa_view(tensor).shape[-2:]
    top_left = structure.kind == "causal" and structure.mask is not None and structure.mask.q_offset == 0
    if structure.kind is None or structure.reading == "key padding [B, S]" or top_left:
        as_matrix = sdpa_view(to_keep(tensor, convention))  # (Lq, Lk) as SDPA reads it, whatever the reading above
        if 1 < q_len < k_len and np.array_equal(as_matrix, np.broadcast_to(np.tri(q_len, k_len, dtype=bool), as_matrix.shape)):
            result.append(Finding(
                "top-left-causal",
                ("read as an (Lq, Lk) mask instead, it is " if structure.reading == "key padding [B, S]" else "")
                + f"causal aligned top-left (query row q sees keys 0..q, torch.tril of a {q_len}x{k_len} matrix, "
                f"causal_upper_left, SDPA's is_causal=True): with {k_len - q_len} cached keys the new queries usually "
                f"sit at the end; bottom-right is maskcli show causal --offset {k_len - q_len} --len {q_len}",
            ))
    if convention.sentinel is not None:  # the lowest finite fill (-inf needs no check: it is -inf in every dtype)
        lowest = convention.sentinel
        for dtype in ("float16", "bfloat16"):
            if dtype_name(tensor) == dtype or lowest >= FLOAT_MIN[dtype]:
                continue
            if rounded(lowest, dtype) == float("-inf"):
                result.append(Finding(
                    "sentinel-overflow",
                    f"the fill value {lowest:.6g} does not fit {dtype} (lowest {FLOAT_MIN[dtype]:.6g}): "
                    f"cast to {dtype} it becomes -inf, so a fully masked row gives NaN "
                    f"(maskcli convert --to min --dtype {dtype} writes finfo({dtype}).min)",
                ))
    if convention.name == "int" and convention.ones_mean == "masked":
        result.append(Finding(
            "ones-masked",
            "1 marks the masked cells here: masked_fill(mask.bool(), -inf) applies it right, "
            "masked_fill(mask == 0, -inf) applies it backwards",
        ))
    if heads is not None:
        if tensor.ndim == 3 and tensor.shape[0] == heads and heads > 1:
            result.append(Finding(
                "3d-heads",
                f"the 3-D mask's first dimension is {heads}, the head count: SDPA applies it per head, but "
                f"nn.MultiheadAttention expects batch x heads there and gives each head the wrong mask once batch > 1 "
                f"(repeat it: mask.repeat(B, 1, 1) for a batch of B)",
            ))
        elif tensor.ndim == 3 and tensor.shape[0] not in (1, heads):
            result.append(Finding(
                "3d-shape",
                f"the 3-D mask's first dimension is {tensor.shape[0]}: SDPA needs 1 or the head count {heads} there; "
                f"nn.MultiheadAttention needs batch x heads = {heads} x B",
            ))
        elif tensor.ndim == 4 and tensor.shape[1] not in (1, heads):
            result.append(Finding(
                "heads-mismatch",
                f"the mask has {tensor.shape[1]} heads (dimension 1) but the model has {heads}: it broadcasts only when they are equal or it is 1",
            ))
    return result


