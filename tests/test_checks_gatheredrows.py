"""checks/gatheredrows.py: a causal mask's rows gathered by query (ProbSparse's top-u queries, out of order) are not read
as padding (padding-seen-by-one, padding-per-head) nor as later keys (sees-later); a causal mask in query order and a
padding mask with a row built apart are still read."""

from __future__ import annotations

import torch

import maskcli
from maskcli.checks.registry import severity

READ_AS_ROWS = ("padding-seen-by-one", "padding-per-head", "sees-later")


def _codes(mask: torch.Tensor) -> list:
    """Findings of a softmax over (2, 2, Lq, 8) scores filled with -inf where `mask` (True = masked) says."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, mask.shape[-2], 4), torch.randn(2, 2, 8, 4)
    with maskcli.trace() as t, torch.no_grad():
        scores = (q @ k.transpose(-2, -1)).masked_fill(mask, float("-inf"))
        torch.softmax(scores, dim=-1)
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings]


def _prob_mask(index: torch.Tensor) -> torch.Tensor:
    """Informer's ProbMask: triu(1) rows of the queries `index` (B, H, u) picked, gathered in that order."""
    triu = torch.ones(8, 8, dtype=torch.bool).triu(1)
    return triu[index]


def test_causal_rows_gathered_out_of_order_are_not_read_as_padding():
    generator = torch.Generator().manual_seed(3)
    every = torch.stack([torch.stack([torch.randperm(8, generator=generator) for _ in range(2)]) for _ in range(2)])
    assert not [c for c in _codes(_prob_mask(every)) if c[0] in READ_AS_ROWS]  # (u = L: every query, shuffled)
    some = every[..., :5]  # (u < L: five queries of each head, in the order ranked)
    assert not [c for c in _codes(_prob_mask(some)) if c[0] in READ_AS_ROWS]


def test_rows_in_query_order_and_a_row_built_apart_are_still_read():
    in_order = _prob_mask(torch.arange(8).expand(2, 2, 8))  # (a plain causal mask: named causal, nothing to say)
    assert not [c for c in _codes(in_order) if c[1] in ("wrong", "suspicious")]
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    masked = ~(valid[:, None, :, None] & valid[:, None, None, :]).expand(2, 2, 8, 8).clone()
    masked[:, :, 0] = False  # (a CLS row left all ones: it sees row 1's padding, theislab/CellFlow#226)
    assert ("padding-seen-by-one", "wrong") in _codes(masked)
