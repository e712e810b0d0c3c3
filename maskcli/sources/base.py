"""What a source declares: its name, its `load`, and, for a source read from a --mask FILE, which files it claims."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Source:
    name: str
    load: Callable  # load(spec, options, ...) -> Mask
    # claims(text, options) -> bool: for a source read from a --mask FILE, whether this file is its (the registry asks
    # the file sources in order, the first that claims it reads it); None for sources given otherwise
    claims: Callable | None = None
