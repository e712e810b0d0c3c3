"""The kinds of mask, each defined once (see base.Kind); the registry collects them."""

from maskcli.kinds.registry import all_kinds, flags, get, names

__all__ = ["all_kinds", "flags", "get", "names"]
