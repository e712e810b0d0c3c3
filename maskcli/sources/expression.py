"""A mask described by an expression of kinds ("causal & window(4096)"), the mask options giving its sizes and
batch data; a loaded mask_mod's name is a kind of it too (`kinds`)."""

from __future__ import annotations

from maskcli.mask import Mask, MaskOptions, build
from maskcli.sources.base import Source


def load(expression: str | None, options: MaskOptions, default_length: int | None = None, kinds: dict | None = None,
         before=None, after=None) -> Mask:
    """The Mask the expression describes over the sizes the options give (`default_length` where they give none);
    `before`, `after`: terms another source bound (a packed batch's documents, a config's layer type), and-ed around
    it as they are (the expression None: they alone)."""
    return build(expression, options, default_length=default_length, kinds=kinds, before=before, after=after)


SOURCE = Source("expression", load)
