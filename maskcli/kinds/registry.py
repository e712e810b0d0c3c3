"""Every kind, collected from the modules of this package: adding a kind is adding a module.

Each module other than base, values and registry defines a tuple `KINDS`; the registry
imports them all once, orders them by rank, and answers lookups by name or alias.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil
from pathlib import Path

from maskcli.errors import MaskError
from maskcli.text import shortened
from maskcli.kinds.base import Kind, Param

_NOT_KINDS = {"base", "values", "registry"}


@functools.cache
def all_kinds() -> tuple[Kind, ...]:
    """Every kind, simplest first."""
    kinds: list[Kind] = []
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if module.name not in _NOT_KINDS:
            kinds.extend(importlib.import_module(f"maskcli.kinds.{module.name}").KINDS)
    names = [name for kind in kinds for name in (kind.name, *kind.aliases)]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise RuntimeError(f"kinds defined twice: {', '.join(duplicated)}")
    return tuple(sorted(kinds, key=lambda kind: (kind.rank, kind.name)))


@functools.cache
def _by_name() -> dict[str, Kind]:
    return {name: kind for kind in all_kinds() for name in (kind.name, *kind.aliases)}


def names() -> tuple[str, ...]:
    return tuple(kind.name for kind in all_kinds())


def get(name: str, where: str | None = None) -> Kind:
    """The kind called `name` (or an alias of it); an unknown name suggests the nearest."""
    kind = _by_name().get(name)
    if kind is not None:
        return kind
    close = difflib.get_close_matches(name, list(_by_name()), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    raise MaskError(f"unknown mask kind {shortened(name, 60)!r}{' in ' + where if where else ''}: {hint}the kinds are {', '.join(names())} (maskcli kinds explains each)")


def flags() -> dict[str, list[tuple[Kind, Param]]]:
    """Each parameter flag and the kinds that read it: --window -> [(window, its Param)]."""
    table: dict[str, list[tuple[Kind, Param]]] = {}
    for kind in all_kinds():
        for param in kind.params:
            table.setdefault(param.flag, []).append((kind, param))
            if param.sizes:
                table.setdefault("--sizes", []).append((kind, param))
    return table
