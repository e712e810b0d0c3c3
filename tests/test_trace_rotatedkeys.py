"""trace/rotatedkeys.py: which key each query was rotated like, read off the (cos, sin) factors the program multiplied
its queries and keys by (trace/rotated.py keeps them), against a double loop over the positions the test rotated at."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import maskcli.trace.rotatedkeys as rotatedkeys
from maskcli.trace.rotated import Rotations

HEAD = 16


def _factors(positions: list[int], base: float, heads_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD))
    theta = torch.tensor(positions, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((theta, theta), dim=-1)
    emb = emb[None, :, None, :] if heads_last else emb[None, None]
    return emb.cos(), emb.sin()


def _rotate(rotations: Rotations, x: torch.Tensor, positions: list[int], base: float, heads_last: bool) -> None:
    cos, sin = _factors(positions, base, heads_last)
    half = torch.cat((-x[..., HEAD // 2:], x[..., : HEAD // 2]), dim=-1)
    for y, f in ((x, cos), (half, sin)):
        rotations.note((y, f), y * f)  # (what trace's watch on products hands it)


def _read(queries: list[int], keys: list[int], base: float = 10000.0, heads_last: bool = False) -> dict | None:
    rotations, details = Rotations(), {}
    shape = (2, len(queries), 3, HEAD) if heads_last else (2, 3, len(queries), HEAD)
    _rotate(rotations, torch.randn(shape), queries, base, heads_last)
    shape = (2, len(keys), 3, HEAD) if heads_last else (2, 3, len(keys), HEAD)
    _rotate(rotations, torch.randn(shape), keys, base, heads_last)
    found, keyed, _ = rotations.take(len(queries), len(keys))
    if keyed:
        rotatedkeys.note(details, found, keyed)
    return details.get("rotated_like")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=3), st.lists(st.integers(0, 3000), min_size=4, max_size=40),
       st.sampled_from([10000.0, 500.0, 1e6]), st.booleans())
def test_each_query_matches_the_keys_rotated_at_its_position(queries, keys, base, heads_last):
    """Against a double loop over the positions: the first key at the query's position and how many are."""
    like = _read(queries, keys, base, heads_last)
    assert like is not None
    for q, position in enumerate(queries):
        same = [j for j, key in enumerate(keys) if key == position]
        assert like["count"][0][q] == len(same)
        assert like["first"][0][q] == (same[0] if same else -1)


def test_a_decode_step_over_a_cache_rotated_again():
    """keras-hub's layout ((batch, tokens, heads, width), the factor [None, :, None, :]): a query at 0 over keys at
    0..7 is key 0's; at 7, key 7's."""
    assert _read([0], list(range(8)), heads_last=True) == {"first": [[0]], "count": [[1]]}
    assert _read([7], list(range(8)), heads_last=True) == {"first": [[7]], "count": [[1]]}


def test_nothing_where_the_keys_were_not_rotated_at_the_call():
    """A cache of keys rotated when stored: only the step's own key is rotated beside the query (one row each), so no
    factor holds as many rows as the keys and nothing is read."""
    rotations, details = Rotations(), {}
    for _ in range(2):
        _rotate(rotations, torch.randn(1, 2, 1, HEAD), [9], 10000.0, False)
    found, keyed, _ = rotations.take(1, 10)
    assert keyed == [] and len(found) == 4
    assert "rotated_like" not in details


def test_a_factor_that_is_no_rotation_is_left_out():
    """Products by broadcast factors whose squares do not sum to 1 (a scale, xPos's decayed cos) read as nothing."""
    rotations, details = Rotations(), {}
    for rows in (1, 6):
        x = torch.randn(1, 2, rows, HEAD)
        for _ in range(2):
            f = torch.rand(1, 1, rows, HEAD) * 0.5
            rotations.note((x, f), x * f)
    found, keyed, _ = rotations.take(1, 6)
    rotatedkeys.note(details, found, keyed)
    assert "rotated_like" not in details


def _spread_reference(factor_shape: tuple, out_shape: tuple) -> tuple:
    """By a loop over the axes (right-aligned): the product's sizes over axes the factor has as 1 or lacks, save the
    width, where the factor is one rotation (one row on every axis)."""
    if any(n != 1 for n in factor_shape[:-1]):
        return ()
    found = []
    for a in range(len(out_shape) - 1):
        back = len(out_shape) - a
        mine = factor_shape[len(factor_shape) - back] if back <= len(factor_shape) else 1
        if mine == 1 and out_shape[a] > 1:
            found.append(out_shape[a])
    return tuple(found)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=3), st.integers(1, 2))
def test_spread_against_a_loop(dims, lead):
    """One rotation (1, ..., 1, width) over products of every layout: the sizes it is broadcast over."""
    from maskcli.trace.rotated import _spread

    out = torch.zeros(*dims, HEAD)
    factor = torch.ones(*([1] * lead), HEAD)
    assert _spread(factor, out) == _spread_reference(tuple(factor.shape), tuple(out.shape))
    assert _spread(torch.ones(2, HEAD), torch.zeros(3, 2, HEAD)) == ()  # (two rows: not one rotation)


def test_one_rotation_broadcast_over_the_calls_tokens_is_said_not_over_its_heads():
    """ring-attention's (b, n, h, d) with one head: a (1, 1, d) pair over 12 tokens is the queries' (12 in the call's
    (2, 1, 12, 12)); HF's decode (1, 1, 1, d) over (1, 8, 1, d) spreads over the heads only."""
    rotations, details = Rotations(), {}
    cos, sin = _factors([0], 10000.0, False)
    x = torch.randn(2, 12, 1, HEAD)
    for f in (cos[0, 0], sin[0, 0]):
        rotations.note((x, f), x * f)
    found, keyed, flat = rotations.take(12, 12)
    rotatedkeys.flat(details, flat, (2, 1, 12, 12))
    assert details["rotated_flat"] == [12]
    rotations, details = Rotations(), {}
    x = torch.randn(1, 8, 1, HEAD)
    for f in (cos, sin):
        rotations.note((x, f), x * f)
    rotatedkeys.flat(details, rotations.take(1, 8)[2], (1, 8, 1, 8))
    assert "rotated_flat" not in details
