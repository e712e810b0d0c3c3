"""Loading a mask tensor from a file or inline JSON, and refusing what cannot be a mask."""

from __future__ import annotations

import math

import numpy as np

from maskcli.errors import MaskError
from maskcli.tensorfile import as_array, dtype_name

MASK_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
WIDE_UNSIGNED = ("uint16", "uint32", "uint64")  # masks only where they hold 0 and 1


# --- loading and refusing -----------------------------------------------------------


def check_maskable(values, where: str) -> np.ndarray:
    """The values as a numpy array of a mask dtype, or a one-line MaskError saying why they cannot be a mask.

    numpy arrays come from every file but .pt; a torch tensor (a .pt file's) is checked for what only torch
    has (quantized, meta, sparse) and converted here, its edge. bfloat16 comes back widened (tensorfile.BFLOAT16).
    """
    name = dtype_name(values)
    if name.startswith("complex"):
        raise MaskError(f"{where} holds complex numbers ({name}), which cannot be a mask")
    torch_in = not isinstance(values, np.ndarray)
    if torch_in and values.is_quantized:
        raise MaskError(f"{where} is a quantized tensor ({name}); a mask is bool, 0/1 or float")
    if torch_in and values.device.type == "meta":
        raise MaskError(f"{where} is a meta tensor: it has a shape but no values")
    shape = list(values.shape)
    if len(shape) > 4:
        raise MaskError(f"{where} has {len(shape)} dimensions {shape}: a mask has at most 4 (B, H, Lq, Lk)")
    if not shape:
        raise MaskError(f"{where} is a single number ({values.item()}), not a mask: a mask has shape (Lq, Lk) up to (B, H, Lq, Lk)")
    if math.prod(shape) == 0:
        raise MaskError(f"{where} is empty (shape {shape})")
    if torch_in and str(values.layout) != "torch.strided":
        try:
            values = values.to_dense()
        except Exception as error:  # some layouts have no dense form for some dtypes
            raise MaskError(f"{where} is a {values.layout} tensor that cannot be made dense ({str(error).splitlines()[0][:120]})") from None
    if name not in MASK_DTYPES + WIDE_UNSIGNED:
        raise MaskError(
            f"{where} has dtype {name}, which cannot be a mask here: "
            "use bool, an integer type or float16/bfloat16/float32/float64"
        )
    values = as_array(values)
    if name in WIDE_UNSIGNED:
        if int(values.max()) > 1:  # only 0/1 matter; larger values are refused by classify anyway
            raise MaskError(f"{where} ({name}) holds values above 1; a mask is bool, 0/1 or float")
        values = values.astype(np.int64)
    return values


def load_mask(source: str, key: str | None = None, flag: str = "FILE", work: tuple[float, str] = (0, "to load")) -> tuple[np.ndarray, str]:
    """The one tensor in `source` (the one named `key` where there are several) as a numpy array checked to be
    maskable, and its label; only a .pt file imports torch. `work`: the bytes per cell the caller needs beside the
    array, and what for (an .npz too large for it is refused from its headers, before it is unpacked)."""
    from maskcli.tensorfile import is_inline, read_tensors

    tensors = read_tensors(source, flag, work=work)
    label = "the inline JSON" if is_inline(source) else repr(source)
    from maskcli.text import names_text

    names = names_text(k for k in tensors if k)
    if key is not None:
        if key not in tensors:
            holds = f"it holds {names}" if names else "it holds one unnamed tensor: drop --key"
            raise MaskError(f"{label} has no tensor {key!r}; {holds}")
        tensor = tensors[key]
        label += f" [{key!r}]"
    elif len(tensors) == 1:
        tensor = next(iter(tensors.values()))
    elif not tensors:
        raise MaskError(f"{label} holds no tensors")
    else:
        kernel = _kernel_format(tensors)
        if kernel is not None:
            raise MaskError(f"{label} holds {kernel}'s tensors ({names}), as maskcli export --save writes them: read it with --from {kernel}")
        raise MaskError(f"{label} holds several tensors ({names}): choose one with --key")
    return check_maskable(tensor, label), label


KERNEL_TENSORS = {"flash-attn": "cu_seqlens_q", "flashmask": "startend_row_indices", "magi": "q_ranges", "flex": "kv_num_blocks"}


def _kernel_format(tensors: dict) -> str | None:
    """The kernel format (as --from names it) whose telltale tensor the file holds, if any."""
    return next((name for name, tensor in KERNEL_TENSORS.items() if tensor in tensors), None)


