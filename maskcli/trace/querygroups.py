"""How many query groups a running module states it trains with: Group-DETR's groups (checks/querygroups.py).

Group DETR trains a DETR decoder with G groups of object queries at once, each group decoded on its own: its
self-attention must never let one group see another (a block-diagonal mask over the queries, or, as detrex and
LW-DETR / RF-DETR do it, the groups moved into the batch axis in training: `torch.cat(q.split(N // G), dim=1)`).
A running module (the attention module or the decoder layer around it, innermost first)
that holds an int field of FIELDS above 1 states G; the split is a training device (in inference one group is
decoded), so the module's `training` flag is recorded beside it. One dict lookup per field and module a call.

A config the module keeps (`self.config`, `self.cfg`: an object, a dataclass or a dict, as LW-DETR keeps its
LwDetrConfig) states G where it holds an int `group_detr` or `group_nums` above 1 and, beside it, the queries of each
group (`num_queries`): then the G groups hold G * num_queries queries, recorded as "queries". `num_query_groups` is
never read off a config (Megatron's config names its grouped-query attention's key/value groups so). Read only where
the module keeps a value under a config's name (a dict lookup a name), fields by a static read.
"""

from __future__ import annotations

from maskcli.checks.intent import NAMES, config_like
from maskcli.checks.configread import field_reader

FIELDS = ("group_nums", "group_detr", "num_query_groups")  # detrex Group-DETR, LW-DETR / RF-DETR, their ports
CONFIG_FIELDS = ("group_detr", "group_nums")  # a config's (its num_query_groups may be GQA's: Megatron)
QUERIES = ("num_queries", "num_query")  # a group's object queries, as DETR configs name them
INNERMOST = 2  # running modules read, innermost first: the attention module and its layer (an encoder beside
# the decoder, under a transformer that holds the field, is no group of queries)


def note(details: dict, stack: list) -> None:
    """details["query_groups"] = {"field", "groups", "module", "training"} of the innermost running module that
    states a number of query groups above 1; nothing where none does."""
    for module in reversed(stack[-INNERMOST:]):
        own = module.__dict__
        for field in FIELDS:
            value = own.get(field)
            if type(value) is int and value > 1:
                details["query_groups"] = {"field": field, "groups": value, "module": type(module).__name__,
                                           "training": bool(own.get("training", False))}
                return
        for name in NAMES:
            config = own.get(name)
            if config is None or not config_like(config, named=True):
                continue
            stated = _stated(config)
            if stated is not None:
                field, groups, queries = stated
                details["query_groups"] = {"field": f"{name}.{field}", "groups": groups, "queries": queries,
                                           "module": type(module).__name__,
                                           "training": bool(own.get("training", False))}
                return


def _stated(config) -> tuple[str, int, int] | None:
    """(field, G, queries a group) where a config states G > 1 query groups and each group's queries."""
    get = field_reader(config)
    for field in CONFIG_FIELDS:
        groups = get(field)
        if type(groups) is int and groups > 1:
            queries = next((q for q in map(get, QUERIES) if type(q) is int and q > 1), None)
            return None if queries is None else (field, groups, queries)
    return None
