"""Attention weights dropped at random while the model states it runs for inference (`model.eval()`).

trace/evaldrop.py records on an attention call (details `eval_dropout`) a dropout of its weights that trains (a
dropout the program calls itself with training left True, `F.dropout(attn, p)` or `torch.dropout(attn, p,
train=True)`; SDPA handed `dropout_p > 0`) while the innermost module running it says `training=False`. The module's
mode is the program's statement; a dropout that ignores it makes inference random: the same input gives other outputs
at every call (shiyu-coder/Kronos 8715716, written blind: its decoder's own attention function dropped weights with
`train=True` through the forecast loop). Said once per call site.
"""

from __future__ import annotations

from maskcli.checks.registry import Rule
from maskcli.checks.softmaxed import once_per_site
from maskcli.text import Finding


def dropped_in_eval(run) -> list:
    """(call, Finding) for each call site whose weights were dropped while its module was in eval mode."""
    found = []
    for call, said in once_per_site(run, "eval_dropout"):
        how = {"dropout_p": f"SDPA is handed dropout_p={said['p']:g}",
               "F.dropout": f"F.dropout(weights, p={said['p']:g}) leaves training=True (its default)",
               }.get(said["by"], f"{said['by']}(weights, {said['p']:g}, train=True)")
        found.append((call, Finding("dropout-in-eval", (
            f"{said['module']} is in eval mode (training=False), yet {how}: its attention weights are dropped at "
            f"random at inference, so the same input gives another output at every call; pass the module's mode "
            f"(training=self.training, dropout_p=self.p if self.training else 0.0)"),
            expected="no dropout of the weights in eval mode", source=f"{said['module']}.training=False")))
    return found


RULES = (
    Rule("dropout-in-eval", "wrong", "call", "attention weights dropped (a dropout told to train, or SDPA's dropout_p "
         "> 0) inside a module in eval mode: inference made random", dropped_in_eval),
)
