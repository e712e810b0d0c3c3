"""What a source declares: its name, its `load`, for a source read from a --mask FILE which files it claims, and for a
source of metadata (a batch) how it is read before its masks are made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Source:
    name: str
    load: Callable  # load(spec, options, ...) -> Mask, or a list of them (a batch's requests, a layout's ranks)
    # claims(text, options) -> bool: for a source read from a --mask FILE, whether this file is its (the registry asks
    # the file sources in order, the first that claims it reads it); None for sources given otherwise
    claims: Callable | None = None
    # read(spec, ...) -> the metadata the masks come from (an engine's batch, a packed batch), for a command that
    # checks it beyond its masks (serve's pages and writes, pack's paths; pack's fields given as options come as
    # further arguments); None where the source reads no metadata
    read: Callable | None = None
