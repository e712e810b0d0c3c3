"""Views of the canonical keep mask (bool, True = may attend) in the other conventions.

| convention | values                         | who uses it                                  |
| keep       | bool, True = attend            | SDPA attn_mask, FlexAttention create_mask     |
| block      | bool, True = masked            | nn.MultiheadAttention attn_mask, key_padding |
| additive   | float, 0 / -inf                | triu(full(-inf), 1), generate_square_subsequent_mask |
| min        | float, 0 / finfo(dtype).min    | Hugging Face eager masks                     |
| int        | 0 / 1                          | torch.tril(torch.ones(L, L)) in tutorials     |
"""

from __future__ import annotations

import torch

from maskcli.spec import CONVENTIONS

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def to_convention(keep: torch.Tensor, convention: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The keep mask written in `convention`; `dtype` is used by the float conventions."""
    if convention == "keep":
        return keep.clone()
    if convention == "block":
        return ~keep
    if convention == "int":
        return keep.to(torch.int64)
    if convention in ("additive", "min"):
        fill = float("-inf") if convention == "additive" else torch.finfo(dtype).min
        out = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        return out.masked_fill_(~keep, fill)
    raise ValueError(f"unknown convention {convention!r}; known: {', '.join(CONVENTIONS)}")


def bytes_per_cell(convention: str, dtype: torch.dtype = torch.float32) -> int:
    if convention in ("keep", "block"):
        return 1
    if convention == "int":
        return 8
    return torch.finfo(dtype).bits // 8


def cell_texts(convention: str, dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """How a visible and a masked cell print in `convention`: (visible, masked)."""
    if convention == "min":
        return "0", f"{torch.finfo(dtype).min:.2g}"
    return {
        "keep": ("1", "0"),
        "block": ("False", "True"),
        "additive": ("0", "-inf"),
        "int": ("1", "0"),
    }[convention]


def describe(convention: str, dtype: torch.dtype = torch.float32) -> str:
    """One phrase naming the convention and what its values mean."""
    visible, masked = cell_texts(convention, dtype)
    if convention == "keep":
        return "keep (bool, 1 = True = may attend, 0 = masked)"
    dtype_note = f" {str(dtype).removeprefix('torch.')}" if convention in ("additive", "min") else ""
    return f"{convention}{dtype_note} ({visible} = may attend, {masked} = masked)"
