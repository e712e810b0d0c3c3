"""A mask from the user's own mask_mod (--mask-mod FILE.py:NAME, or module:NAME): a kind named after the function,
so it can stand alone or in an expression. Only that flag runs the user's code (usermods.py loads it).
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.sources.base import Source


def kinds(spec: str | None, args: str | None) -> dict:
    """{name: kind} for --mask-mod, loaded (running the user's code) only when that flag is given."""
    if spec is None:
        if args is not None:
            raise MaskError("--mask-mod-args is for --mask-mod: give --mask-mod FILE.py:NAME too")
        return {}
    from maskcli.kinds import names
    from maskcli.usermods import kind, load

    name, function, origin = load(spec, args)
    if name in names() or name == "prefill":
        raise MaskError(f"--mask-mod {spec!r}: {name} is the name of a maskcli kind; rename your function or import it under another name")
    return {name: kind(name, function, origin)}


def load(spec: str, options, default_length: int | None = None):
    """The mask the mask_mod `spec` names, standing alone over the sizes the options give."""
    from maskcli.mask import build

    found = kinds(spec, options.mask_mod_args)
    return build(next(iter(found)), options, default_length=default_length, kinds=found)


SOURCE = Source("usermod", "--mask-mod FILE.py:NAME", "the user's own mask_mod, a kind named after the function", load)
