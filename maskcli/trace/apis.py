"""The attention APIs trace records, by name, and a request for them checked (no torch: `maskcli trace --help` reads them)."""

from __future__ import annotations

from maskcli.errors import MaskError

APIS = ("sdpa", "flex", "mha", "softmax", "flash", "hf", "vllm")


def checked(apis, known: tuple[str, ...] = APIS) -> tuple[str, ...]:
    """The APIs to record: names from `known`, as a list or one comma-separated string; anything else is refused
    (apis="bogus", or "sdpa" read letter by letter, would record nothing without a word)."""
    names = [part.strip() for part in apis.split(",")] if isinstance(apis, str) else apis
    try:
        names = list(names)
    except TypeError:
        raise MaskError(f"trace(apis={apis!r}): give a list of API names ({', '.join(known)})") from None
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise MaskError(f"trace(apis={apis!r}): {repr(unknown[0]) + ' is not' if unknown else 'no API is'} one that maskcli "
                        f"records; choose from {', '.join(known)}")
    return tuple(names)
