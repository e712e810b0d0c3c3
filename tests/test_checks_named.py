"""checks/named.py: what the recogniser named, said as a finding; the naming itself is test_trace.py's (end to end)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from maskcli.checks.named import closest, polarity, same_as
from maskcli.inspect.structure import recognise


def test_a_causal_mask_in_the_wrong_polarity_is_named_with_how_the_api_reads_it():
    keep = ~np.tril(np.ones((4, 4), dtype=bool))[None, None]  # torch.triu(ones, 1): MHA's block mask read as keep
    flipped = recognise(~keep)
    assert flipped.kind == "causal"
    [found] = polarity(SimpleNamespace(api="sdpa"), flipped.kind, flipped.expression)
    assert found.message == ("read the other way round it is causal: a mask in the wrong polarity? "
                             "(SDPA reads a bool mask as True = may attend)")
    assert polarity(SimpleNamespace(api="sdpa"), "tril", "tril(1)") == []  # a raw matrix either way round says nothing
    assert polarity(SimpleNamespace(api="sdpa"), None, None) == []


def test_two_names_for_the_same_cells_and_the_nearest_expression():
    local = SimpleNamespace(expression="local(2)")
    assert same_as(local, "document(sizes=[2,2])")[0].message == "local(2) is also document(sizes=[2,2]): the same cells"
    assert same_as(local, None) == []
    near = SimpleNamespace(closest={"expression": "causal", "rows": ["row 1: +key 2", "row 2: +key 3", "row 3"]})
    assert closest(near)[0].message == "against causal: row 1: +key 2; row 2: +key 3"
    assert closest(SimpleNamespace(closest=None)) == []
