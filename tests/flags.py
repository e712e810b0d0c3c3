"""Build a mask the way the command line does from a kind name and its flags (for tests)."""

from __future__ import annotations

from maskcli.mask import MaskOptions, build

KIND_FLAGS = {"diagonal": "--diagonal", "means": "--means", "window": "--window", "prefix": "--prefix",
              "chunks": "--chunks", "sink": "--sink", "chunk_size": "--chunk-size", "sizes": "--sizes"}


def from_flags(expression: str, **flags):
    """build(expression) with keyword flags as on the command line: from_flags("window", length=8, window=3)."""
    params = {KIND_FLAGS[name]: flags.pop(name) for name in list(flags) if name in KIND_FLAGS and flags[name] is not None}
    return build(expression, MaskOptions(**flags, params=params))


def about(kind: str, offset: int | None = None):
    """A small mask of `kind` for code that reads only what a mask is (findings read names and offsets)."""
    options = {"padding": {"lengths": "1"}, "window": {"params": {"--window": 1}}, "prefix": {"params": {"--prefix": 1}}}.get(kind, {})
    return build(kind, MaskOptions(length=1, offset=offset, **options))
