"""How a mask tensor's shape broadcasts, and which attention APIs take it as it is."""

from __future__ import annotations

import numpy as np

from maskcli.inspect.polarity import Convention, marks

# --- shapes as SDPA and nn.MultiheadAttention read them ------------------------------


def broadcast_text(tensor: np.ndarray) -> str:
    """How the shape broadcasts to (B, H, Lq, Lk), in words."""
    shape = list(tensor.shape)
    if tensor.ndim == 1:
        return (
            f"[S={shape[0]}]: SDPA broadcasts it to (1, 1, 1, {shape[0]}), one row of keys shared by every batch row, "
            "head and query (a key padding row)"
        )
    if tensor.ndim == 2:
        return f"[Lq={shape[0]}, Lk={shape[1]}] broadcasts over batch and heads to (1, 1, {shape[0]}, {shape[1]})" + (
            f"; as a key padding mask it is [B={shape[0]}, S={shape[1]}]" if shape[0] != shape[1] else ""
        )
    if tensor.ndim == 3:
        n = shape[0]
        return (
            f"[{n}, Lq={shape[1]}, Lk={shape[2]}]: SDPA broadcasts its first dimension as {n} heads "
            f"(1, {n}, {shape[1]}, {shape[2]}), the same for every batch row; nn.MultiheadAttention reads it as "
            f"batch x heads = {n}, a different mask per batch row and head"
        )
    batch, heads, q_len, k_len = shape
    notes = [f"{name}=1 broadcasts over {what}" for name, size, what in
             (("B", batch, "the batch"), ("H", heads, "heads"), ("Lq", q_len, "queries")) if size == 1]
    return f"[B={batch}, H={heads}, Lq={q_len}, Lk={k_len}]" + (f": {', '.join(notes)}" if notes else "")


# --- which APIs take it as is --------------------------------------------------------


def _as_bool(expr: str, tensor: np.ndarray, convention: Convention, want: str) -> str:
    """Python (torch) for `expr` as a bool mask where True means `want` ("attend" or "masked")."""
    if marks(convention) == want:
        return expr if tensor.dtype == bool else f"{expr}.bool()"
    return f"~{expr}" if tensor.dtype == bool else f"({expr} == 0)"


def api_fits(tensor: np.ndarray, convention: Convention, key_padding: bool = False) -> list[str]:
    """For SDPA attn_mask, nn.MultiheadAttention attn_mask and key_padding_mask: yes as is, or the expression to pass instead."""
    name, dims, shape = convention.name, tensor.ndim, tensor.shape
    floats = name in ("additive", "min", "bias")
    fits = []

    sdpa = "F.scaled_dot_product_attention attn_mask: "
    heads_note = ", its first dimension read as heads" if dims == 3 else ""
    if key_padding:
        keep_form = "mask" if floats else _as_bool("mask", tensor, convention, "attend")
        sdpa += f"no, SDPA reads 2-D as (Lq, Lk), not [B, S]; pass {keep_form}[:, None, None, :]"
    elif name == "keep":
        sdpa += f"yes, as is (True = attend){heads_note}"
    elif floats:
        sdpa += f"yes, as is (added to the scores; in the query's dtype){heads_note}"
    elif name == "block":
        sdpa += "no, SDPA reads True as attend; pass ~mask"
    elif tensor.dtype.kind == "f":
        sdpa += f"no, a float mask is added to the scores, so 0/1 masks nothing; pass {_as_bool('mask', tensor, convention, 'attend')}"
    else:
        sdpa += f"no, it takes bool or float; pass {_as_bool('mask', tensor, convention, 'attend')}"
    fits.append(sdpa)

    mha = "nn.MultiheadAttention attn_mask: "
    if key_padding:
        mha += "no, a [B, S] padding mask goes to key_padding_mask"
    elif dims == 1:
        mha += "no, it takes 2-D (L, S) or 3-D (B*num_heads, L, S); a 1-D key row goes to key_padding_mask"
    else:
        shaped = "mask"
        if dims == 4:
            shaped = "mask[0, 0]" if shape[0] == 1 and shape[1] == 1 else "mask.expand(-1, num_heads, -1, -1).flatten(0, 1)"
        if dims in (2, 3) and (name == "block" or floats):
            mha += "yes, as is" + (" (True = masked)" if name == "block" else " (added to the scores)")
        else:
            reason = "it takes 2-D (L, S) or 3-D (B*num_heads, L, S)" if dims == 4 else "MHA reads True as masked" if name == "keep" else "it takes a bool block or float mask"
            fixed = shaped if floats or name == "block" else _as_bool(shaped, tensor, convention, "masked")
            mha += f"no, {reason}; pass {fixed}"
    fits.append(mha)

    kpm = "nn.MultiheadAttention key_padding_mask: "
    row_shaped = (dims == 2 and (key_padding or shape[0] != shape[1])) or dims == 1 or (dims == 4 and shape[1] == 1 and shape[2] == 1)
    if row_shaped:
        shaped = {1: "mask.expand(B, -1)", 2: "mask", 4: "mask[:, 0, 0]"}[dims]
        ok = name == "block" or name in ("additive", "min")
        if dims == 2 and ok:
            kpm += "yes, as is" if key_padding else f"yes, if its rows are batch items ([B={shape[0]}, S={shape[1]}])"
        else:
            fixed = shaped if ok else _as_bool(shaped, tensor, convention, "masked")
            kpm += f"no, it takes [B, S] with True = padding; pass {fixed}"
        fits.append(kpm)
    return fits


