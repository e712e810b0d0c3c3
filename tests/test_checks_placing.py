"""checks/placing.py: where a call's queries sit among its keys (queries), read once per call and model call."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from maskcli.checks.context import Top


def test_queries_sit_at_cache_positions_that_count_up_but_not_at_positions_that_restart():
    import numpy as np

    from maskcli.checks.placing import queries

    call = SimpleNamespace(shape=(1, 2, 6, 10), details={})
    cached = Top("model", arguments={"input_pos": np.arange(4, 10)[None]})
    assert queries(call, cached).tolist() == [4, 5, 6, 7, 8, 9]  # a cache's slots: where the keys are
    # torchtune's packed input_pos restarts at each document: no cache placement, the queries are the last keys
    packed = Top("model", arguments={"input_pos": np.array([[0, 1, 2, 0, 1, 2]])})
    square = SimpleNamespace(shape=(1, 2, 6, 6), details={})
    assert queries(square, packed).tolist() == [k for k in range(6)]


def test_a_cache_position_of_no_axis_places_nothing():
    """A model call handed cache_position=torch.tensor(4) (0-d: the hunt's x27) states no query's position: queries()
    places them at the end of the keys, as with no argument (was an IndexError, "a maskcli bug")."""
    import numpy as np

    from maskcli.checks.placing import queries

    class Call:
        shape, details = (1, 1, 2, 6), {}

    for given in (np.array(4), np.array([[4, 5]])):
        top = Top("model", arguments={"cache_position": given, "position_ids": np.array(3)})
        assert queries(Call(), top).tolist() == [4, 5]  # (the 0-d one: the end of the keys; the 2-D one: as stated)


def test_the_placing_is_read_once_read_only_and_again_when_the_call_says_more():
    """queries() is asked of every call by every rule: it is read once per call and model call (the same array, which
    no rule may change), and read again where the call's details gained a fact (trace settles a static buffer's
    unwritten slots after the call: the end of the keys moves back by them)."""
    from maskcli.checks.placing import queries

    call = SimpleNamespace(shape=(1, 1, 2, 8), details={})
    top = Top("model", arguments={})
    first = queries(call, top)
    assert first.tolist() == [6, 7] and queries(call, top) is first
    with pytest.raises(ValueError):
        first[0] = 0
    call.details["unwritten"] = 3  # (a static buffer's last 3 slots, zero in K and V)
    assert queries(call, top).tolist() == [3, 4]
    assert queries(call, Top("other", arguments={"start_pos": 1})).tolist() == [1, 2]
