"""Every way a mask comes in, and the one call each command makes for the mask the user gave (`mask`).

Each source is a module of sources/ with a `SOURCE` (sources/base.py) and its `load`; a new one is added to
MODULES. A --mask FILE goes to the first file source that claims it: a trace's call, a kernel format's tensors
(--from FORMAT), else one tensor. The sources of metadata (engine, packed, ranks) are asked by name: `read` gives a
command the metadata itself (serve's batches, pack's and shard's packed batches), their `load` its Masks.
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.mask import Mask, MaskOptions, parse_region
from maskcli.sources.base import Source

MODULES = ("expression", "usermod", "trace", "kernel", "tensor",  # the file sources in the order they are asked
           "engine", "packed", "ranks")  # masks implied by metadata: a serving batch, a packed batch, a rank layout

_SOURCES: dict[str, Source] | None = None


def sources() -> dict[str, Source]:
    """Every source by name, in MODULES' order (imported on first use: the registry's importers stay light)."""
    global _SOURCES
    if _SOURCES is None:
        from maskcli.sources import expression, kernel, tensor, trace, usermod
        from maskcli.sources import engine, packed, ranks

        modules = {"expression": expression, "usermod": usermod, "trace": trace, "kernel": kernel, "tensor": tensor}
        modules |= {"engine": engine, "packed": packed, "ranks": ranks}
        _SOURCES = {modules[name].SOURCE.name: modules[name].SOURCE for name in MODULES}
    return _SOURCES


def read(name: str, spec: str | None, *args, **options):
    """The metadata source `name` reads from `spec` (an engine's batch, a packed batch), before its masks are made:
    for a command that checks it beyond its masks; `options`, what the source reads besides its file (pack's fields
    given as options)."""
    return sources()[name].read(spec, *args, **options)


def for_file(text: str, options: MaskOptions) -> Source:
    """The source that reads a --mask FILE (the first file source that claims it)."""
    return next(source for source in sources().values() if source.claims is not None and source.claims(text, options))


def from_file(path: str, options: MaskOptions, flag: str = "--mask") -> Mask:
    """The Mask a --mask FILE holds (`flag` names where it was given: --mask, or diff's A or B)."""
    return for_file(path, options).load(path, options, flag)


def load(expression: str | None, options: MaskOptions, default_length: int | None = None, before=None,
         after=None) -> Mask:
    """The mask an expression, a --mask file or a --mask-mod describes (an expression may use the mask_mod's name),
    viewed over the region --rows and --keys give. `before`, `after`: terms another source bound (shard's packed
    batch documents, --model's layer type), and-ed around the expression's (`mask.build`)."""
    return region(_load(expression, options, default_length, before, after), options)


def values(file: str, key: str | None, from_: str | None, work: tuple[float, str]) -> tuple:
    """The tensor a FILE holds as inspect reads it, before it is a Mask: (values, label, a traced call's key padding or
    None, whether it is in keep form already). A traced call (TRACE.pt:N) is in keep form and may carry the
    key_padding_mask it was given; any other file is one tensor (sources/tensor.py's load_mask), --key choosing it.
    `work`: the bytes per cell the caller needs beside the values, and what for."""
    from maskcli.sources import tensor, trace

    traced = trace.traced_keep(file)
    if traced is None:
        found, label = tensor.load_mask(file, key, work=work)
        return found, label, None, False
    if key is not None or from_ is not None:
        raise MaskError(f"--key and --from do not apply to {file!r}: a traced call's mask is in keep form already")
    found, label = traced
    return found, label, trace.traced_details(file).get("key_padding"), True


def region(mask: Mask, options: MaskOptions) -> Mask:
    """The mask, or the region of it that --rows and --keys give."""
    if options.rows is None and options.keys is None:
        return mask
    return mask.crop(parse_region(options.rows, "--rows"), parse_region(options.keys, "--keys"))


def _load(expression: str | None, options: MaskOptions, default_length: int | None = None, before=None,
          after=None) -> Mask:
    from maskcli.sources import usermod

    kinds = usermod.kinds(options.mask_mod, options.mask_mod_args)
    if options.mask_file is not None:
        if expression is not None:
            raise MaskError(f"give an expression or --mask {options.mask_file!r}, not both: the file is the whole mask")
        if kinds:
            raise MaskError("give --mask or --mask-mod, not both")
        return from_file(options.mask_file, options)
    for flag, value in (("--key", options.key), ("--from", options.from_)):
        if value is not None:
            raise MaskError(f"{flag} {value} is for --mask FILE: give --mask too, or drop {flag}")
    if expression is None and before is None and after is None:  # with bound terms and no expression: they alone
        if not kinds:
            raise MaskError("give a mask: an expression like \"causal & window(3)\", --mask FILE, or --mask-mod FILE.py:NAME (maskcli kinds lists the kinds)")
        expression = next(iter(kinds))
    return sources()["expression"].load(expression, options, default_length, kinds, before, after)
