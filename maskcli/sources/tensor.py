"""A mask from a tensor file (--mask FILE: .pt, .npy, .npz, .safetensors, .json, or inline JSON), read in its own
convention: recognised by its values and structure (inspect/polarity), or named with --from keep / --from block.

The file's one tensor (or the one --key names) becomes a Mask over its cells, its queries at the end of its keys
unless --offset says where they sit. tensorfile/ reads the file types (one module each, by suffix); a file holding
a kernel format's tensors is read by sources/kernel.py, a traced call (TRACE.pt:N) by sources/trace.py.
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.mask import Mask, MaskOptions, from_tensor
from maskcli.sources.base import Source


def load(path: str, options: MaskOptions, flag: str = "--mask") -> Mask:
    """The keep mask in a tensor file, as (B, H, Lq, Lk), named by the file and the convention it was read in
    (`flag` names where it was given: --mask, or diff's A or B; --key and --from come in `options`)."""
    from maskcli.inspect.polarity import Convention, classify, sdpa_view, to_keep

    key, from_ = options.key, options.from_

    if options.causal:
        raise MaskError("--causal is for --from flash-attn or flashmask: give --from too, or drop --causal")
    # classify, to_keep and the keep view each take a bool copy
    values, label = load_mask(path, key, flag, work=(3, "to read as a mask"))  # numpy: only a .pt file imports torch
    convention = classify(values, label) if from_ is None else Convention(from_, "values", "given with --from")
    if from_ is not None and values.dtype.kind == "f" and bool(((values != 0) & (values != 1)).any()):
        raise MaskError(f"--from is for bool and 0/1 masks; {label} holds other values ({classify(values, label).note})")
    if convention.name == "bias":
        raise MaskError(f"{label} is not a mask but an additive bias ({convention.note})")
    if not convention.sure and from_ is None:
        raise MaskError(f"cannot tell whether {label} is keep or block ({convention.note}): say which with --from keep or --from block")
    keep = sdpa_view(to_keep(values, convention))
    described = f"{convention.name}" + (", 1 = masked" if convention.name == "int" and convention.ones_mean == "masked" else "")
    return placed(keep, f"{label} (read as {described})", path, options)


def placed(keep: np.ndarray, text: str, path: str, options: MaskOptions) -> Mask:
    """A Mask over a file's keep cells (B, H, Lq, Lk), its queries at the end of its keys unless --offset says where."""
    _, heads, q_len, k_len = keep.shape
    if options.heads != 1 and heads not in (1, options.heads):
        raise MaskError(f"--mask {path!r} has {heads} heads but --heads is {options.heads}: give --heads {heads}, or drop it")
    if options.heads > heads:
        keep = np.broadcast_to(keep, (keep.shape[0], options.heads, q_len, k_len))
    for flag, value in (("--len", options.length), ("--kv-len", options.kv_len), ("--align", options.align), ("--lengths", options.lengths),
                        ("--ids", options.ids), ("--tokens", None)):
        if value is not None:
            raise MaskError(f"{flag} does not apply to --mask {path!r}: the file's shape {list(keep.shape)} says the sizes; drop {flag}")
    if options.params:
        flag = next(iter(options.params))
        raise MaskError(f"{flag} does not apply to --mask {path!r}: it is for a bare kind in an expression")
    q_start = options.offset if options.offset is not None else max(0, k_len - q_len)  # a cache puts the queries last
    k_start = options.kv_start or 0
    return from_tensor(np.ascontiguousarray(keep), text, q_start, k_start)


def load_mask(source: str, key: str | None = None, flag: str = "FILE", work: tuple[float, str] = (0, "to load")) -> tuple[np.ndarray, str]:
    """The one tensor in `source` (the one named `key` where there are several) as a numpy array checked to be
    maskable, and its label; only a .pt file imports torch. `work`: the bytes per cell the caller needs beside the
    array, and what for (an .npz too large for it is refused from its headers, before it is unpacked)."""
    from maskcli.inspect.polarity import check_maskable
    from maskcli.tensorfile import is_inline, read_tensors

    tensors = read_tensors(source, flag, work=work)
    label = "the inline JSON" if is_inline(source) else repr(source)
    from maskcli.text import names_text

    names = names_text([k for k in tensors if k])  # (a list: a generator would call back into this module)
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


def _claims(text: str, options: MaskOptions) -> bool:
    """Any file not claimed before it (a trace's call, a kernel format's tensors): read as one tensor."""
    return True


SOURCE = Source("tensor", load, _claims)
