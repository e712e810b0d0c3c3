"""Attention weights dropped while the module that attends is in eval mode.

`model.eval()` states that the model runs for inference: every module's `training` is False, and nn.Dropout, MHA and
transformers' attention interfaces drop nothing then. A dropout the program calls itself on a softmax's weights
(`F.dropout(attn, p)`, whose `training` defaults to True; `torch.dropout(attn, p, train=True)`: Kronos before
8715716) or an SDPA call handed `dropout_p > 0` keeps dropping at random whatever the module states, so the same input
gives another output at every call. Recorded on the attention call (details `eval_dropout`: the rate, the module and
how it was dropped) where the rate is above 0, the dropout is told to train, and the innermost running module of the
call's frames is in eval mode (checks/evaldrop.py says it). A module in training mode, a rate of 0, and `training=False`
(the fix: `training=self.training`) are quiet.
"""

from __future__ import annotations

import sys

import torch

from maskcli.trace.sites import running

DROPOUTS = {torch.dropout: ("input", "p", "train"), torch.nn.functional.dropout: ("input", "p", "training"),
            torch.dropout_: ("input", "p", "train")}


def dropped(func, args: tuple, kwargs: dict, call) -> None:
    """A dropout call on `call`'s weights: recorded where it trains inside a module in eval mode."""
    names = DROPOUTS[func]
    given = dict(zip(names, args))
    given.update((name, kwargs[name]) for name in names if name in kwargs)
    rate, train = given.get("p", 0.5), given.get(names[2], True)
    if not isinstance(rate, (int, float)) or not rate > 0 or train is not True:
        return
    _record(call, float(rate), "torch.dropout" if func is not torch.nn.functional.dropout else "F.dropout")


def sdpa(call) -> None:
    """An SDPA call handed dropout_p above 0 (trace/masks.py's details): recorded where its module is in eval mode."""
    rate = call.details.get("dropout_p") or 0.0
    if rate > 0:
        _record(call, float(rate), "dropout_p")


def _record(call, rate: float, by: str) -> None:
    found = running(sys._getframe(2))  # (the module calls running, innermost first: trace/sites.py)
    module = found[0][0] if found else None
    if module is None or module.training or "eval_dropout" in call.details:
        return
    call.details["eval_dropout"] = {"p": rate, "by": by, "module": type(module).__name__}
