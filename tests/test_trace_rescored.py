"""trace/rescored.py: an exp of scores that a softmax then runs over is no softmax written by hand (SAHP's
`exp(q @ kᵀ) / sqrt(d)`, filled and softmaxed); an exp normalised by its row's sum still is one."""

from __future__ import annotations

import math

import torch

import maskcli
from maskcli.checks.context import keep


def _scores():
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    return q @ k.transpose(-1, -2)


def test_an_exp_a_softmax_runs_over_is_withdrawn():
    """One call, the softmax, with the causal mask its fill states, at the exp's index and step."""
    causal = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    with maskcli.trace() as t:
        for _ in range(2):
            scores = torch.exp(_scores()) / math.sqrt(4)
            torch.softmax(scores.masked_fill(causal == 0, -1e9), dim=-1)
    calls = t.calls
    assert [call.index for call in calls] == [0, 1] and [call.step for call in calls] == [0, 1]
    assert all(call.details.get("by_hand") is None for call in calls)
    assert all("over_weights" not in call.details for call in calls)
    cells = keep(calls[0])
    assert (cells[0, 0] == causal[0].numpy()).all()


def test_an_exp_normalised_by_its_sum_stays_a_softmax():
    """exp(x - max) / sum, then a second softmax over those weights: the exp is the first softmax, the second one is
    over its weights."""
    with maskcli.trace() as t:
        scores = _scores()
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        torch.softmax(e / e.sum(-1, keepdim=True), dim=-1)
    assert [call.details.get("by_hand") for call in t.calls] == ["exp", None]
    assert t.calls[1].details.get("over_weights") == t.calls[0].index
