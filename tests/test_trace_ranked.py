"""trace/ranked.py: a topk over attention scores along their keys, carried to the softmax over them, against a loop
over each query row's scores."""

from __future__ import annotations

import torch

from maskcli.trace.capture import Trace


def _best(row: torch.Tensor, k: int, open_: torch.Tensor) -> list[int]:
    """The k highest of a row by a plain sort over its values, -1 where the key picked was not open."""
    order = sorted(range(len(row)), key=lambda j: -float(row[j]))[:k]
    return [j if bool(open_[j]) else -1 for j in order]


def test_the_keys_a_topk_picks_over_masked_scores_reach_the_softmax():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    lowest = torch.finfo(torch.float32).min
    with Trace() as t:
        sim = (q @ k.transpose(-1, -2)).masked_fill(future, lowest)
        kth = sim.topk(2, dim=-1).values[..., -1:]
        sim.masked_fill(sim < kth, lowest).softmax(dim=-1)
    [call] = t.calls
    fact = call.details["topk"]
    sim = (q @ k.transpose(-1, -2)).masked_fill(future, lowest)
    expected = [j for b in range(2) for h in range(3) for i in range(5) for j in _best(sim[b, h, i], 2, ~future[i])]
    assert fact["k"] == 2 and fact["picked"] == expected
    assert -1 in expected  # (query 0 has one open key: its second pick is a masked one)


def test_a_topk_of_the_smallest_scores_is_noted_as_the_keys_dropped():
    torch.manual_seed(1)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with Trace() as t:
        sim = q @ k.transpose(-1, -2)
        dropped = sim.topk(2, dim=-1, largest=False).indices
        sim.scatter(-1, dropped, float("-inf")).softmax(dim=-1)
    [call] = t.calls
    fact = call.details["topk"]
    sim = q @ k.transpose(-1, -2)
    everyone = torch.ones(4, dtype=torch.bool)
    expected = [j for h in range(2) for i in range(4) for j in _best(-sim[0, h, i], 2, everyone)]
    assert fact["smallest"] is True and fact["k"] == 2 and fact["picked"] == expected


def test_a_topk_of_another_tensor_is_not_noted():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with Trace() as t:
        sim = q @ k.transpose(-1, -2)
        torch.randn(1, 2, 4, 4).topk(2, dim=-1)
        sim.softmax(dim=-1)
    [call] = t.calls
    assert "topk" not in call.details
