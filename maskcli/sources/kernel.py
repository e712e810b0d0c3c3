"""A mask from a kernel format's tensors (--mask FILE --from FORMAT, as maskcli export --save writes them): the
format's own reader (formats/, `read`) makes the Mask, exact at any length.
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.mask import Mask, MaskOptions
from maskcli.sources.base import Source


def load(path: str, options: MaskOptions, flag: str = "--mask") -> Mask:
    """The mask a kernel format's tensors describe (maskcli export --save writes them), exact at any length."""
    from maskcli.formats.registry import get, readable

    from_ = options.from_
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


def _claims(text: str, options: MaskOptions) -> bool:
    """--from names something other than a tensor's convention (keep, block): a format, or an unknown name said so."""
    return options.from_ is not None and options.from_ not in ("keep", "block")


SOURCE = Source("kernel", load, _claims)
