"""checks/context.py: Run.made_by, the calls of one model call, against a filter over every call's own index (the run's
calls are a subset of the trace's: engine.py leaves out cross-attention calls and softmaxes of sites that mask
nowhere, so a slice of run.calls at a model call's indices is not its calls)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from maskcli.checks.context import Run, Top


@given(st.sets(st.integers(0, 60)), st.integers(0, 60), st.integers(0, 30))
def test_made_by_is_every_kept_call_whose_index_the_model_call_spans(kept, first, length):
    calls = [SimpleNamespace(index=index, details={}) for index in sorted(kept)]
    top = Top("model", first=first, end=first + length)
    assert Run(calls, [top]).made_by(top) == [call for call in calls if first <= call.index < first + length]


def test_a_model_call_after_a_left_out_call_gets_its_own_calls_not_its_neighbours():
    # the trace's calls 0-5; the engine left out call 1 (an MoE router's softmax) and call 3 (a cross-attention)
    calls = [SimpleNamespace(index=index, details={}) for index in (0, 2, 4, 5)]
    first, second = Top("step 0", first=0, end=3), Top("step 1", first=3, end=6)
    run = Run(calls, [first, second])
    assert [call.index for call in run.made_by(first)] == [0, 2]
    assert [call.index for call in run.made_by(second)] == [4, 5]
    assert [call.index for call in run.calls[second.first:second.end]] == [5]  # (what a slice gave)


def test_threads_making_model_calls_of_their_own_keep_their_own_calls():
    """Two threads' model calls interleaved (ranks run as threads): each call's model call is the latest begun before it
    on its own thread, and made_by keeps a model call's own thread's calls; the main thread's, by a loop."""
    threads = ["A", "B", "A", "B", None, "B", "A"]
    calls = [SimpleNamespace(index=i, details={} if t is None else {"thread": t}) for i, t in enumerate(threads)]
    a, b = Top("a", {}, {"thread": "A"}, 0, 7), Top("b", {}, {"thread": "B"}, 1, 7)
    main = Top("main", first=4, end=5)
    run = Run(calls, [a, b, main])
    for call, thread in zip(calls, threads):
        assert run.top(call) is {"A": a, "B": b, None: main}[thread]
    for top, thread in ((a, "A"), (b, "B")):
        assert [c.index for c in run.made_by(top)] == [i for i, t in enumerate(threads) if t == thread and i >= top.first]


def test_keeps_cells_of_intervals_are_tracefiles_own():
    """context._dense (one interval a row built in one pass, several ORed) against tracefile.dense, on random intervals
    (empty, reversed and past the keys too; one row for every query or one a query)."""
    import numpy as np

    from maskcli import tracefile
    from maskcli.checks.context import _dense

    rng = np.random.default_rng(0)
    for _ in range(300):
        b, h, q, k = (int(x) for x in rng.integers(1, 5, 4))
        rows, intervals = (q if rng.random() < 0.7 else 1), int(rng.integers(1, 3))
        stored = {"form": "intervals", "planes": [b, h], "shape": [b, h, q, k],
                  "starts": rng.integers(-1, k + 1, (b * h, rows, intervals)),
                  "ends": rng.integers(-1, k + 2, (b * h, rows, intervals))}
        assert np.array_equal(_dense(stored), np.broadcast_to(tracefile.dense(stored), (b, h, q, k)))


def test_triu_and_tril_by_a_kept_band_are_numpys():
    """context.triu / tril (a band made once per shape, ANDed) against np.triu / np.tril, on random cells of 2-4 axes,
    square and not, every diagonal offset; the band is read-only."""
    import numpy as np
    import pytest

    from maskcli.checks.context import band, tril, triu

    rng = np.random.default_rng(1)
    for _ in range(200):
        q, k = (int(x) for x in rng.integers(1, 7, 2))
        lead = tuple(int(x) for x in rng.integers(1, 3, int(rng.integers(0, 3))))
        cells = rng.random((*lead, q, k)) < 0.6
        for offset in range(-k - 1, k + 2):
            assert np.array_equal(triu(cells, offset), np.triu(cells, offset))
            assert np.array_equal(tril(cells, offset), np.tril(cells, offset))
    with pytest.raises(ValueError):
        band(3, 3, 1, True)[0, 0] = True


def test_a_module_path_word_for_cross_attention_and_what_is_not_one():
    """context.crossing by the module path: bert4keras ports' `cross_atts.0` (a list of `cross_att`s) is a
    cross-attention, as `cross_attn` and T5's `EncDecAttention` are; `self_atts`, `crossbar`, `flex_attn` are not."""
    from maskcli.checks.context import crossing

    def call(where, q_len=5, k_len=8):
        return SimpleNamespace(where=where, shape=(2, 4, q_len, k_len), details={}, api="softmax")

    for where in ("decoder.cross_atts.0", "decoder.layers.1.cross_att", "model.crossatt", "decoder.cross_attn",
                  "decoder.block.1.layer.1.EncDecAttention"):
        assert crossing(call(where)).cross, where
    for where in ("decoder.self_atts.0", "decoder.crossbar.0", "decoder.layers.0.flex_attn", "decoder.cross_attsx"):
        assert not crossing(call(where)).cross, where
