"""Scores multiplied by a 0/1 mask before their softmax: the cells it leaves out get logit 0, not -inf.

A softmax weighs each key by exp(score): a keep mask multiplied into the scores turns the left-out keys' scores into 0,
which the softmax weighs exp(0) against the kept ones, so the mask hides nothing it meant to (a key scored 0 may even
outweigh the kept ones). The program states which keys it sets apart (the 0/1 tensor itself); the softmax it ran
still weighs them. berniwal/swin-transformer-pytorch ae5ae7b multiplied its 1/0 shifted-window masks into the window
logits (`dots *= mask`), graphormer-pyg f56d6487 its per-graph `batch_mask`. trace/multiplied.py marks the cells the
product zeroed and reads, at the softmax, those still weighed (not filled low since) in rows that weigh other keys.
Quiet where the product is followed by a fill of the zeroed cells (`masked_fill(mask == 0, -inf)`, `+ (1 - mask) *
-1e9`), where the mask is added as 0 / -inf, and where only whole rows are zeroed (a padded query's row).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def multiplied(run: Run) -> list:
    """The first call of each site whose softmax still weighs cells a 0/1 product zeroed (trace/multiplied.py)."""
    firsts = {}
    for call in [*run.calls, *run.cross, *run.unmasked]:
        if call.details.get("multiplied"):
            firsts.setdefault(call.where, call)
    return [(call, _finding(call.details["multiplied"])) for call in firsts.values()]


def _finding(seen: dict) -> Finding:
    return Finding("ones-multiplied", (
        f"the scores were multiplied by a 0/1 mask before the softmax: its 0s set {seen['cells']} cells of "
        f"{seen['rows']} query rows to logit 0, not -inf, and the softmax still weighs them exp(0) beside the keys the "
        f"mask keeps, so it hides nothing (add the mask as 0 / -inf, or masked_fill the scores where it is 0)"),
        expected="the mask's 0s as -inf in the scores", source="a 0/1 tensor multiplied into the scores")


RULES = (
    Rule("ones-multiplied", "wrong", "call", "scores multiplied by a 0/1 keep mask before the softmax: the keys it "
         "leaves out get logit 0, not -inf, and stay weighed (swin-transformer-pytorch's `dots *= mask`)", multiplied),
)
