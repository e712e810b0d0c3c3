"""trace/followed.py: the operands of a product, and a table of tensors followed by identity that lets each go when it
dies."""

from __future__ import annotations

import gc

import torch

from maskcli.trace.followed import KEEP, follow, operands_of


def test_the_operands_of_a_product_einsum_or_not():
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    assert operands_of(torch.matmul, (a, b)) == (a, b)
    assert operands_of(torch.einsum, ("ij,jk->ik", a, b)) == (a, b)
    assert operands_of(torch.einsum, ("ij,jk->ik", [a, b])) == [a, b]


def test_a_followed_tensor_is_let_go_when_it_dies_and_the_table_stays_bounded():
    found: dict = {}
    out = torch.ones(2, 2)
    follow(found, id(out), out, "call", "seen")
    ref, *entry = found[id(out)]
    assert ref() is out and entry == ["call", "seen"]
    del out, ref
    gc.collect()
    assert found == {}
    kept = [torch.ones(1) for _ in range(KEEP + 1)]
    for t in kept:
        follow(found, id(t), t)
    assert len(found) == 1  # (KEEP entries reached: all forgotten, the newest kept)
