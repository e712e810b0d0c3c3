"""The dropout rates a model states for its tokens, found once per outermost module (trace/stated.py).

A structured sequence dropout (Perceiver AR's, perceiver-pytorch's `dropout_seq`) keeps a share of each row's tokens
as the keys of a cross-attention: the share is the rate the model states, a float of (0, 1) under a name with "drop"
in it held by a module (`self.seq_dropout_prob`) or by a config it keeps (a dict, a dataclass: `self.cfg["token_drop"]`).
Each is read as it is held, nothing else of the program kept; checks/dropshare.py decides which of them, if any, says
how many keys a call keeps (the call's key count the kept share of the model call's positions).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from maskcli.checks.intent import Stated

WORD = "drop"
MOST = 8  # rates read at most per model (a model of many dropout fields: the first)


def config_items(value) -> list[tuple[str, object]]:
    """The (name, value) fields of a config a module keeps: a dict's str keys, a dataclass's or a namespace's fields;
    [] for anything else (nothing of the program's own code runs: no getattr)."""
    if isinstance(value, dict):
        return [(k, v) for k, v in list(value.items())[:256] if isinstance(k, str)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type) or isinstance(value, SimpleNamespace):
        try:
            return [(k, v) for k, v in list(vars(value).items())[:256] if isinstance(k, str)]
        except TypeError:  # (a dataclass with slots: no __dict__)
            return []
    return []


def _rate(name: str, value) -> bool:
    return type(value) is float and 0.0 < value < 1.0 and WORD in name.lower()


def rates(root, path) -> list[Stated]:
    """A Stated {"drop_rate": p, "drop_name": its name, "drop_training": its module's mode} for each dropout rate a module of `root` (or a config it
    keeps) states, scope None (for every call: it hides no config of the layers' kinds)."""
    found: list[Stated] = []
    for module in root.modules():
        scope = path(module)
        if scope is None:
            continue
        where = scope or type(module).__name__
        for name, value in list(vars(module).items()):
            if name.startswith("_") or isinstance(value, (torch.nn.Module, torch.Tensor)):
                continue
            if _rate(name, value):
                found.append(Stated(f"self.{name}={value:g} of {where}", None,
                                    {"drop_rate": value, "drop_name": name, "drop_scope": scope,
                                     "drop_training": module.training}))
                continue
            for field, held in config_items(value):
                if _rate(field, held):
                    found.append(Stated(f"self.{name}.{field}={held:g} of {where} ({type(value).__name__})", None,
                                        {"drop_rate": held, "drop_name": field, "drop_scope": scope,
                                         "drop_training": module.training}))
            if len(found) >= MOST:
                return found
    return found
