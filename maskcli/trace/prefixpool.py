"""What a vision model states of its pooling's prefix tokens: a count of them, and that the pool leaves them out.

A ViT that puts class and register tokens before its patches (timm's `num_prefix_tokens`: `x[:, num_prefix_tokens:]`
are the patches) states with a bool `pool_include_prefix` (NaFlexVit) or `reduce_include_prefix` (timm's
`global_pool_nlc`) = False that its global pooling reads the patches alone: an attention pool (a MAP head, a latent
query over the tokens) attends the patches, not the prefix. Each is read on a module's own attributes or on a config
it keeps (`self.cfg`, `self.config`: a dict, a dataclass, an object), the count and the flag on the one module (the
model that holds both), for the calls under it: Stated({"prefix_pool": P, "prefix_scope": scope}) for
checks/prefixpool.py. Read once per outermost module (trace/stated.py).
"""

from __future__ import annotations

from maskcli.checks.configread import field_reader
from maskcli.checks.intent import NAMES, Stated, config_like

COUNTS = ("num_prefix_tokens",)
FLAGS = ("pool_include_prefix", "reduce_include_prefix", "include_prefix_in_pool")


def _said(module) -> tuple[int, str, str] | None:
    """(P, count's name, flag's name) where the module, or a config it keeps, states P > 0 prefix tokens and a pool
    flag False; None otherwise."""
    own = vars(module)
    readers = [("self", own.get)] + [(f"self.{name}", field_reader(own[name])) for name in NAMES
                                    if own.get(name) is not None and config_like(own[name], named=True)]
    count = flag = None
    for owner, get in readers:
        if count is None:
            count = next(((v, f"{owner}.{n}") for n in COUNTS if type(v := get(n)) is int and v > 0), None)
        if flag is None:
            flag = next(((v, f"{owner}.{n}") for n in FLAGS if type(v := get(n)) is bool), None)
    if count is None or flag is None or flag[0]:
        return None
    return count[0], count[1], flag[1]


def stated(root, path) -> list:
    """Stated({"prefix_pool": P, "prefix_scope": scope}) of the first module (parents first) that states P prefix
    tokens and a pool that leaves them out."""
    for module in root.modules():
        scope = path(module)
        if scope is None:
            continue
        try:
            said = _said(module)
        except Exception:  # noqa: BLE001 - a config whose reading raises states nothing maskcli can read
            said = None
        if said is not None:
            count, counted, flagged = said
            where = scope or type(module).__name__
            return [Stated(f"{counted}={count} and {flagged}=False of {where}", None,
                           {"prefix_pool": count, "prefix_scope": scope})]
    return []
