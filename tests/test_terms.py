"""terms.py: kinds bound to values in one call (refused ones left out), each tree's intervals at one frame as
mask.placed makes them (or its refusal), and a tree's name and folding, against masks built from text and a double
loop over absolute positions."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.errors import MaskError
from maskcli.kinds import get as get_kind
from maskcli.mask import MaskOptions, build, placed
from maskcli.positions import Frame
from maskcli.terms import Term, bound, bound_each, folded, placed_each, text


def test_bound_each_binds_as_bound_does_and_leaves_out_each_refused_value():
    found = bound_each([(get_kind("window"), {"window": 3}), (get_kind("window"), {"window": 0}),
                        (get_kind("sink"), {"sink": 2}), (get_kind("tril"), {})])
    assert found[1] is None
    with pytest.raises(MaskError, match="at least 1"):
        bound(get_kind("window"), {"window": 0})
    assert [term.text() for term in (found[0], found[2], found[3])] == ["window(3)", "sink(2)", "tril(0)"]
    assert found[0] == build("window(3)").expression


@pytest.mark.parametrize("expression", ["causal", "window(3)", "sink(2)", "document(0,0,1,1,1,2)",
                                        "causal & (window(2) | sink(1))", "~window(2) | prefix(2)"])
def test_placed_each_gives_the_cells_of_the_mask_placed_at_the_frame(expression):
    tree = build(expression).expression
    frame = Frame(0, 6, 0, 6)
    got = placed_each([tree], frame)[0]
    keep = placed(tree, MaskOptions(length=6)).dense()[0, 0]
    assert np.array_equal(got.dense(0, 0, 6), keep)
    if expression == "causal":  # and against a double loop
        assert np.array_equal(keep, np.array([[k <= q for k in range(6)] for q in range(6)]))


def test_placed_each_says_where_placed_refuses():
    labels, sinks = build("document(0,0,1,1)").expression, build("sink(5)").expression
    found = placed_each([labels, sinks, build("causal").expression], Frame(0, 3, 0, 3))
    assert isinstance(found[0], MaskError) and isinstance(found[1], MaskError)  # 4 labels, 5 sinks, 3 positions
    for tree in (labels, sinks):
        with pytest.raises(MaskError):
            placed(tree, MaskOptions(length=3))
    assert np.array_equal(found[2].dense(0, 0, 3), np.tril(np.ones((3, 3), dtype=bool)))


def test_a_trees_name_and_its_folding():
    tree = build("causal & (window(2) | sink(1)) & causal").expression
    assert text(tree) == "causal & (window(2) | sink(1)) & causal"
    assert text(folded(tree)) == "causal & (window(2) | sink(1))"
    distinct = build("causal & ~window(2)").expression
    assert folded(distinct) is distinct  # no repeat: evaluated as it is
    assert isinstance(bound(get_kind("causal"), {}), Term)
