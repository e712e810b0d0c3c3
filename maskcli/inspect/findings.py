"""What looks wrong with a mask tensor: rows that see nothing, later keys a kind does not mean,
fills that overflow in float16/bfloat16, a 3-D mask whose first dimension is the head count."""

from __future__ import annotations

import numpy as np

from maskcli.conventions import FLOAT_MIN, rounded
from maskcli.inspect.polarity import Convention, sdpa_view, to_keep
from maskcli.inspect.structure import Structure, fully_masked_rows
from maskcli.tensorfile import dtype_name
from maskcli.text import Finding, spans


def _where(b: int, h: int, shape) -> str:
    parts = [f"batch {b}"] if shape[0] > 1 else []
    if shape[1] > 1:
        parts.append(f"head {h}")
    return f" ({', '.join(parts)})" if parts else ""


def findings(tensor: np.ndarray, convention: Convention, keep4: np.ndarray, structure: Structure,
             heads: int | None = None, q_offset: int = 0) -> list[Finding]:
    """Rows that see nothing, later keys a kind does not mean, fills that overflow, a 3-D heads trap, and more."""
    result: list[Finding] = []
    q_len, k_len = keep4.shape[-2:]
    empty = fully_masked_rows(keep4)  # (B, H, Lq)
    if structure.reading == "key padding [B, S]":
        batch_rows = np.flatnonzero(empty[:, 0, 0]).tolist()
        if batch_rows:
            who = f"batch row {batch_rows[0]} hides" if len(batch_rows) == 1 else f"batch rows {spans(batch_rows)} hide"
            result.append(Finding("fully-masked", f"{who} every key: a length-0 sequence, whose queries see no key at all"))
    else:
        for b, h in np.argwhere(empty.any(axis=-1)).tolist():
            if h > 0 and np.array_equal(empty[b, h], empty[b, 0]):
                continue  # the same rows as head 0: said once
            rows = [q_offset + i for i in np.flatnonzero(empty[b, h]).tolist()]
            who = f"query row {rows[0]} sees" if len(rows) == 1 else f"query rows {spans(rows)} see"
            result.append(Finding(
                "fully-masked",
                f"{who} no key at all{_where(b, h, keep4.shape)}: softmax over nothing, NaN with an -inf fill and "
                "uniform weights over the masked keys with a finite one (maskcli verify shows what each backend does)",
            ))
    # later keys are worth a word unless a kind that means them rebuilds the mask (tril/triu mean them only by accident)
    if structure.reading == "mask" and structure.kind in (None, "tril", "triu"):
        offset = k_len - q_len
        later = np.triu(keep4, k=offset + 1)  # on the last two axes
        any_later = later.any(axis=-1).any(axis=(0, 1))  # (Lq,)
        rows = np.flatnonzero(any_later).tolist()
        if rows:
            b, h = (int(x) for x in np.argwhere(later[..., rows[0], :].any(axis=-1))[0])
            keys = np.flatnonzero(later[b, h, rows[0]]).tolist()
            where = _where(b, h, keep4.shape).strip(" ()")
            example = f"query {q_offset + rows[0]} sees key{'s' if len(keys) > 1 else ''} {spans(keys)}" + (f" in {where}" if where else "")
            shown = [q_offset + r for r in rows]
            who = f"query row {shown[0]} sees" if len(rows) == 1 else f"query rows {spans(shown)} see"
            if structure.kind is not None:
                message = (
                    f"{who} later keys ({example}): {structure.expression} "
                    "reaches past the diagonal, which a causal mask does not (an off-by-one?)"
                )
            elif len(rows) < q_len / 2:
                message = f"{who} later keys while the others do not: an off-by-one in a causal mask? ({example})"
            else:
                message = f"{who} later keys ({example}): a bidirectional mask, or one read the wrong way round?"
            result.append(Finding("sees-later", message))
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


