"""How many query groups a running module states it trains with: Group-DETR's groups (checks/querygroups.py).

Group DETR trains a DETR decoder with G groups of object queries at once, each group decoded on its own: its
self-attention must never let one group see another (a block-diagonal mask over the queries, or, as detrex and
LW-DETR / RF-DETR do it, the groups moved into the batch axis in training: `torch.cat(q.split(N // G), dim=1)`).
A running module (the attention module or the decoder layer around it, innermost first)
that holds an int field of FIELDS above 1 states G; the split is a training device (in inference one group is
decoded), so the module's `training` flag is recorded beside it. One dict lookup per field and module a call.
"""

from __future__ import annotations

FIELDS = ("group_nums", "group_detr", "num_query_groups")  # detrex Group-DETR, LW-DETR / RF-DETR, their ports
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
