"""Views of the canonical keep mask (bool, True = may attend) in the other conventions.

| convention | values                         | who uses it                                  |
| keep       | bool, True = attend            | SDPA attn_mask, FlexAttention create_mask     |
| block      | bool, True = masked            | nn.MultiheadAttention attn_mask, key_padding |
| additive   | float, 0 / -inf                | triu(full(-inf), 1), generate_square_subsequent_mask |
| min        | float, 0 / finfo(dtype).min    | Hugging Face eager masks                     |
| int        | 0 / 1                          | torch.tril(torch.ones(L, L)) in tutorials     |

Numpy arrays and torch tensors both work; only a torch tensor (or bfloat16) needs torch.
"""

from __future__ import annotations

import numpy as np

CONVENTIONS: dict[str, str] = {
    "keep": "bool, True = may attend (SDPA attn_mask, FlexAttention create_mask)",
    "block": "bool, True = masked (nn.MultiheadAttention attn_mask / key_padding_mask)",
    "additive": "float, 0 = attend, -inf = masked (added to the scores)",
    "min": "float, 0 = attend, finfo(dtype).min = masked (Hugging Face eager masks)",
    "int": "integer, 1 = attend, 0 = masked (torch.tril(torch.ones(L, L)))",
}
DTYPES = ("float32", "float16", "bfloat16", "float64")
# the lowest finite value and the size of each float dtype: bfloat16 has numpy's float32 range at 16 bits
FLOAT_MIN = {
    "float32": float(np.finfo(np.float32).min),
    "float16": float(np.finfo(np.float16).min),
    "bfloat16": -3.3895313892515355e38,
    "float64": float(np.finfo(np.float64).min),
}
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def rounded(value: float, dtype: str) -> float:
    """`value` as a float `dtype` holds it, as torch casts a Python float: to float32, then to the nearest
    (ties to even) float16 or bfloat16; past the largest finite value by half a step it is inf. Without torch."""
    with np.errstate(over="ignore"):
        single = np.float32(value)
        if dtype != "bfloat16":
            return float(single.astype(dtype))
    bits = int(single.view(np.uint32))
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16) & 0xFFFFFFFF  # bfloat16: float32's top half, rounded
    return float(np.uint32(bits).view(np.float32))


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def to_convention(keep, convention: str, dtype: str = "float32"):
    """The keep mask written in `convention` (numpy in, numpy out; a torch tensor in, a tensor out).

    bfloat16, which numpy lacks, comes back as a torch tensor either way. A keep mask is bool: an integer or float
    one is refused (its ~ is a bitwise not, and a float's truth is any nonzero: -1e9 would read as kept).
    """
    numpy_in = isinstance(keep, np.ndarray)
    kind = keep.dtype if numpy_in else getattr(keep, "dtype", None)
    if not numpy_in and type(keep).__module__.partition(".")[0] != "torch" or kind is None:
        raise TypeError(f"to_convention takes a bool keep mask, a numpy array or a torch tensor (True = may attend); "
                        f"got {type(keep).__name__}")
    if str(kind) not in ("bool", "torch.bool"):
        raise TypeError(f"to_convention takes a bool keep mask (True = may attend); got dtype {kind}: give mask.bool() "
                        f"where nonzero means kept, or compare it first (mask == 0 for an additive mask)")
    if convention == "keep":
        return keep.copy() if numpy_in else keep.clone()
    if convention == "block":
        return ~keep
    if convention == "int":
        return keep.astype(np.int64) if numpy_in else keep.long()
    if convention not in ("additive", "min"):
        raise ValueError(f"unknown convention {convention!r}; known: {', '.join(CONVENTIONS)}")
    fill = float("-inf") if convention == "additive" else FLOAT_MIN[dtype]
    if numpy_in and dtype != "bfloat16":
        return np.where(keep, np.zeros((), dtype=dtype), np.asarray(fill, dtype=dtype))
    import torch

    keep = torch.tensor(keep) if numpy_in else keep  # a copy: the array may be a read-only broadcast view
    return torch.zeros(keep.shape, dtype=torch_dtype(dtype), device=keep.device).masked_fill_(~keep, fill)


def bytes_per_cell(convention: str, dtype: str = "float32") -> int:
    if convention in ("keep", "block"):
        return 1
    if convention == "int":
        return 8
    return FLOAT_BYTES[dtype]


def cell_texts(convention: str, dtype: str = "float32") -> tuple[str, str]:
    """How a visible and a masked cell print in `convention`: (visible, masked)."""
    if convention == "min":  # whole, as finfo prints it: -65504, not -6.6e+04; the wider ones in short
        low = FLOAT_MIN[dtype]
        return "0", f"{low:.0f}" if abs(low) < 1e6 else f"{low:.2g}"
    return {
        "keep": ("1", "0"),
        "block": ("0", "1"),
        "additive": ("0", "-inf"),
        "int": ("1", "0"),
    }[convention]


def describe(convention: str, dtype: str = "float32") -> str:
    """One phrase naming the convention and what its values mean."""
    visible, masked = cell_texts(convention, dtype)
    if convention == "keep":
        return "keep (bool, 1 = True = may attend, 0 = masked)"
    if convention == "block":
        return "block (bool, 1 = True = masked, 0 = may attend)"
    dtype_note = f" {dtype}" if convention in ("additive", "min") else ""
    return f"{convention}{dtype_note} ({visible} = may attend, {masked} = masked)"
