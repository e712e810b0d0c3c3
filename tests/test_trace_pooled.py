"""trace/pooled.py: the softmax results it holds are known by their own tensor, not by an id a dead one left."""

from __future__ import annotations

import gc
import weakref

import torch

from maskcli.trace.pooled import Pooled


def _dead_ref() -> weakref.ref:
    gone = torch.zeros(1)
    ref = weakref.ref(gone)
    del gone
    gc.collect()
    assert ref() is None
    return ref


def test_a_view_whose_id_a_dead_result_left_is_read_through_its_base():
    """PaddleRec's MIND (tests/data/bugs): `unsqueeze(softmax(B, dim=2), 2)` took the id of a softmax result freed
    before it, and the pooling was missed one run in two (the stale entry taken for the view's own). The axis of the
    view is its base's axis laid where the same size and stride sit: 2 of (3, 4, 12) is 3 of (3, 4, 1, 12)."""
    pooled = Pooled()
    weights = torch.softmax(torch.randn(3, 4, 12), dim=2)
    pooled.note((weights, 2), {}, weights)
    view = weights.unsqueeze(2)
    assert pooled._axis(view) == 3
    pooled.held[id(view)] = (_dead_ref(), 1)  # (what a freed result of that address left behind)
    assert pooled._axis(view) == 3
    assert pooled._axis(weights) == 2


def test_a_tensor_never_held_has_no_axis_whatever_its_id_held():
    pooled = Pooled()
    other = torch.randn(3, 4)
    pooled.held[id(other)] = (_dead_ref(), 1)
    assert pooled._axis(other) is None
