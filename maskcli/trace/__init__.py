"""Capture the masks a running program hands to its attention calls: `with maskcli.trace() as t: model(x)`.

The package itself is callable, so `maskcli.trace()` works whether or not a submodule has
been imported (which binds maskcli.trace to this package); it imports torch only when called.
"""

from __future__ import annotations

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, apis=None, max_bytes: int | None = None):
        """A Trace to use as a context manager: `with maskcli.trace() as t:`; then t.calls and t.report(). `apis`:
        which of sdpa, flex, mha, softmax, flash, hf to record (all by default)."""
        from maskcli.trace.capture import DEFAULT_MAX_BYTES, Trace

        return Trace(apis, DEFAULT_MAX_BYTES if max_bytes is None else _bytes(max_bytes))  # (apis: checked by Trace)


def _bytes(max_bytes) -> int:
    import operator

    from maskcli.errors import MaskError

    try:
        if isinstance(max_bytes, bool):
            raise TypeError
        value = operator.index(max_bytes)
    except TypeError:
        raise MaskError(f"trace(max_bytes={max_bytes!r}): give a whole number of bytes (an int)") from None
    if value < 0:
        raise MaskError(f"trace(max_bytes={value}): a size is 0 or more bytes")
    return value


sys.modules[__name__].__class__ = _CallablePackage
