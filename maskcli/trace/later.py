"""An outermost module call's Top made once the run is over, where nothing it reads can change behind it.

Making a Top (tops.py's `top`: a dozen readers of the call's arguments, its config and its cache) costs about a
third of a millisecond a model call, on a traced generate's hot path. Where the call was handed only plain values
(None, numbers, strings), integer or bool tensors of at most 2 dimensions (ids, masks, positions: each copied here,
one torch call, so that the program may change its own after the call) and a Hugging Face cache (what `top` reads
of it, which grows, read here), the Top is made from those copies when the run's tops are read (Outer.made); the
once-a-model reads that depend on when they run (its token ids, its convolutions, the tokenizer its frames held) are
read or found here. Anything else (a float input, an object, a list, a loss owed to the call) and the Top is made as
the call ends, as before: the Top is the same either way.
"""

from __future__ import annotations

import torch

from maskcli.trace.padded import MOST
from maskcli.trace.tokenizer import _HELD as _TOKENIZERS
from maskcli.trace.tops import _convs, _given, _token_ids, cache_read, top

PLAIN = frozenset({type(None), bool, int, float, str})
CACHES = ("cache", "past_key_values")  # (tops.cache_read's names)


class Later:
    """A Top to make once the run is over: the call's arguments as copied when it ended."""

    __slots__ = ("where", "module", "given", "first", "end", "held", "cached", "config", "stated", "convs", "pools",
                 "permuted")

    def make(self):
        """The Top, as `top` would have made it when the call ended (None where it raises: no Top, as then)."""
        try:
            made = top(self.where, self.module, (), self.given, self.first, self.end, held=self.held, cached=self.cached)
        except (Exception, SystemExit):  # noqa: BLE001 - (as Outer._finish: what the call states is then unknown)
            return None
        if getattr(self.module, "config", None) is not self.config:  # (the program replaced its model's config since)
            from maskcli.checks.intent import StaticView, dynamic

            made.config = StaticView(self.config) if self.config is not None and dynamic(self.config) else self.config
        if self.stated is not None:
            made.stated = self.stated
        made.convs = getattr(self, "convs", ())  # (what its convolutions read: trace/convpad.py)
        made.pools = getattr(self, "pools", ())  # (the positions its poolings weigh: trace/poolweights.py)
        made.permuted = getattr(self, "permuted", ())  # (its tokens reordered by a gather: trace/permuted.py)
        return made


def later(where: str, module, args: tuple, kwargs: dict, first: int, end: int, held: dict | None) -> Later | None:
    """The call's Top to make later, or None where it must be made now (module docstring)."""
    if not isinstance(module, torch.nn.Module) or module not in _TOKENIZERS:  # (its tokenizer read as it was called)
        return None
    _, given = _given(module, args, kwargs)
    copied = {}
    for name, value in given.items():
        kind = type(value)
        if kind in PLAIN:
            copied[name] = value
        elif kind is torch.Tensor:
            if value.is_floating_point() or value.is_complex() or value.dim() > 2 or value.numel() > MOST \
                    or value.requires_grad:
                return None
            copied[name] = value.clone()
        elif name in CACHES and kind.__module__.startswith("transformers."):
            copied[name] = value  # (its reads made now: cache_read)
        else:
            return None
    found = Later()
    found.where, found.module, found.given, found.first, found.end, found.held = where, module, copied, first, end, held
    found.cached, found.config, found.stated = cache_read(given), getattr(module, "config", None), None
    _token_ids(module), _convs(module)  # (read once per model, now: as `top` would have read them at its first call)
    return found
