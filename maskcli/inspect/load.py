"""Loading a mask tensor from a file or inline JSON, and refusing what cannot be a mask."""

from __future__ import annotations

import torch

from maskcli.errors import MaskError

MASK_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)
WIDE_UNSIGNED = tuple(getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- loading and refusing -----------------------------------------------------------


def check_maskable(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """The tensor as a plain CPU tensor of a mask dtype, or a one-line MaskError saying why it cannot be a mask."""
    if tensor.is_complex():
        raise MaskError(f"{where} holds complex numbers ({dtype_name(tensor.dtype)}), which cannot be a mask")
    if tensor.is_quantized:
        raise MaskError(f"{where} is a quantized tensor ({dtype_name(tensor.dtype)}); a mask is bool, 0/1 or float")
    if tensor.device.type == "meta":
        raise MaskError(f"{where} is a meta tensor: it has a shape but no values")
    if tensor.dim() > 4:
        raise MaskError(f"{where} has {tensor.dim()} dimensions {list(tensor.shape)}: a mask has at most 4 (B, H, Lq, Lk)")
    if tensor.dim() == 0:
        raise MaskError(f"{where} is a single number ({tensor.item()}), not a mask: a mask has shape (Lq, Lk) up to (B, H, Lq, Lk)")
    if tensor.numel() == 0:
        raise MaskError(f"{where} is empty (shape {list(tensor.shape)})")
    if tensor.layout != torch.strided:
        try:
            tensor = tensor.to_dense()
        except Exception as error:  # some layouts have no dense form for some dtypes
            raise MaskError(f"{where} is a {tensor.layout} tensor that cannot be made dense ({str(error).splitlines()[0][:120]})") from None
    if tensor.dtype in WIDE_UNSIGNED:
        if int(tensor.to(torch.float64).max()) > 1:  # only 0/1 matter; larger values are refused below anyway
            raise MaskError(f"{where} ({dtype_name(tensor.dtype)}) holds values above 1; a mask is bool, 0/1 or float")
        tensor = tensor.to(torch.int64)
    if tensor.dtype not in MASK_DTYPES:
        raise MaskError(
            f"{where} has dtype {dtype_name(tensor.dtype)}, which cannot be a mask here: "
            "use bool, an integer type or float16/bfloat16/float32/float64"
        )
    return tensor.detach().cpu()


def load_mask(source: str, key: str | None = None, flag: str = "FILE") -> tuple[torch.Tensor, str]:
    """The one tensor in `source` (the one named `key` where there are several), checked to be maskable, and its label."""
    from maskcli.tensorfile import is_inline, load_tensors

    tensors = load_tensors(source, flag)
    label = "the inline JSON" if is_inline(source) else repr(source)
    names = ", ".join(repr(k) for k in tensors if k)
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


