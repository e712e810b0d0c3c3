"""A mask from whatever the user gives: an expression, a tensor file (--mask), or their mask_mod (--mask-mod).

A tensor is read in its own convention (recognised as inspect recognises it, or named
with --from) and becomes a Mask over its cells, its queries at the end of its keys unless
--offset says where they sit. A mask_mod becomes a kind named after the function, so it
can stand alone or in an expression.
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.mask import Mask, MaskOptions, build, from_tensor, parse_region


def mask_from_file(path: str, key: str | None, from_: str | None, options: MaskOptions, flag: str = "--mask") -> Mask:
    """The keep mask in a tensor file, as (B, H, Lq, Lk), named by the file and the convention it was read in
    (`flag` names where it was given: --mask, or diff's A or B)."""
    from maskcli.tracefile import traced_keep

    traced = traced_keep(path)
    if traced is not None:  # TRACE.pt:7 or TRACE.pt:layers.5.self_attn@2, written by maskcli trace --save
        for option, value in (("--key", key), ("--from", from_)):
            if value is not None:
                raise MaskError(f"{option} does not apply to {path!r}: a traced call's mask is already in keep form; drop {option}")
        keep, label = traced
        return _placed(keep, label, path, options)
    from maskcli.inspect.load import load_mask
    from maskcli.inspect.polarity import Convention, classify, sdpa_view, to_keep

    if from_ is not None and from_ not in ("keep", "block"):
        return _from_format(path, from_, options, flag)
    if options.causal:
        raise MaskError("--causal is for --from flash-attn or flashmask: give --from too, or drop --causal")
    # classify, to_keep and the keep view each take a bool copy
    values, label = load_mask(path, key, flag, work=(3, "to read as a mask"))  # numpy: only a .pt file imports torch
    convention = classify(values) if from_ is None else Convention(from_, "values", "given with --from")
    if from_ is not None and values.dtype.kind == "f" and bool(((values != 0) & (values != 1)).any()):
        raise MaskError(f"--from is for bool and 0/1 masks; {label} holds other values ({classify(values).note})")
    if convention.name == "bias":
        raise MaskError(f"{label} is not a mask but an additive bias ({convention.note})")
    if not convention.sure and from_ is None:
        raise MaskError(f"cannot tell whether {label} is keep or block ({convention.note}): say which with --from keep or --from block")
    keep = sdpa_view(to_keep(values, convention))
    described = f"{convention.name}" + (", 1 = masked" if convention.name == "int" and convention.ones_mean == "masked" else "")
    return _placed(keep, f"{label} (read as {described})", path, options)


def _placed(keep: np.ndarray, text: str, path: str, options: MaskOptions) -> Mask:
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


def _from_format(path: str, from_: str, options: MaskOptions, flag: str) -> Mask:
    """The mask a kernel format's tensors describe (maskcli export --save writes them), exact at any length."""
    from maskcli.formats.registry import get, readable
    from maskcli.tensorfile import load_tensors

    try:
        fmt = get(from_, "--from")
    except MaskError:
        fmt = None
    if fmt is None or fmt.read is None:
        raise MaskError(f"unknown --from {from_!r}: choose keep or block (a tensor's convention), or a format: {', '.join(readable())}")
    window = options.params.get("--window")
    for name, value in (("--len", options.length), ("--kv-start", options.kv_start), ("--kv-len", options.kv_len),
                        ("--lengths", options.lengths), ("--ids", options.ids), ("--key", options.key)):
        if value is not None:
            raise MaskError(f"{name} does not apply to --from {fmt.name}: the file says the sizes; drop {name}")
    extra = [flag_ for flag_ in options.params if flag_ != "--window" or fmt.name != "flash-attn"]
    if extra:
        raise MaskError(f"{extra[0]} does not apply to --from {fmt.name}: it is for a bare kind in an expression")
    if options.causal and fmt.name not in ("flash-attn", "flashmask"):
        raise MaskError(f"--causal is for --from flash-attn or flashmask; {fmt.name} files say their own mask types")
    if fmt.name == "flex" and path.lower().endswith(".pt"):  # maskcli blocks --save keeps BLOCK_SIZE as a tuple
        from maskcli.formats.flex import load

        tensors = load(path, flag)
    else:
        tensors = load_tensors(path, flag)
    try:
        found = fmt.read(tensors, {"causal": options.causal, "window": window})
    except MaskError as error:  # the reader names the tensor and its value; the file is named here
        raise MaskError(f"{flag} {path!r}: {error}", error.pointer) from None
    from dataclasses import replace

    if options.offset is not None:  # where the queries sit; the keys are the file's 0..Lk-1
        found = replace(found, frame=replace(found.frame, q_start=options.offset))
    return replace(found, heads=options.heads)  # every head the same mask


def user_kinds(spec: str | None, args: str | None) -> dict:
    """{name: kind} for --mask-mod, loaded (running the user's code) only when that flag is given."""
    if spec is None:
        if args is not None:
            raise MaskError("--mask-mod-args is for --mask-mod: give --mask-mod FILE.py:NAME too")
        return {}
    from maskcli.kinds import names
    from maskcli.usermods import kind, load

    name, function, origin = load(spec, args)
    if name in names() or name == "prefill":
        raise MaskError(f"--mask-mod {spec!r}: {name} is the name of a maskcli kind; rename your function or import it under another name")
    return {name: kind(name, function, origin)}


def build_any(expression: str | None, options: MaskOptions, default_length: int | None = None) -> Mask:
    """The mask an expression, a --mask file or a --mask-mod describes (an expression may use the mask_mod's name),
    viewed over the region --rows and --keys give."""
    return region(_build_any(expression, options, default_length), options)


def region(mask: Mask, options: MaskOptions) -> Mask:
    """The mask, or the region of it that --rows and --keys give."""
    if options.rows is None and options.keys is None:
        return mask
    return mask.crop(parse_region(options.rows, "--rows"), parse_region(options.keys, "--keys"))


def _build_any(expression: str | None, options: MaskOptions, default_length: int | None = None) -> Mask:
    kinds = user_kinds(options.mask_mod, options.mask_mod_args)
    if options.mask_file is not None:
        if expression is not None:
            raise MaskError(f"give an expression or --mask {options.mask_file!r}, not both: the file is the whole mask")
        if kinds:
            raise MaskError("give --mask or --mask-mod, not both")
        return mask_from_file(options.mask_file, options.key, options.from_, options)
    for flag, value in (("--key", options.key), ("--from", options.from_)):
        if value is not None:
            raise MaskError(f"{flag} {value} is for --mask FILE: give --mask too, or drop {flag}")
    if expression is None:
        if not kinds:
            raise MaskError("give a mask: an expression like \"causal & window(3)\", --mask FILE, or --mask-mod FILE.py:NAME (maskcli kinds lists the kinds)")
        expression = next(iter(kinds))
    return build(expression, options, default_length=default_length, kinds=kinds)
