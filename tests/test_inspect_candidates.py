"""inspect/candidates.py: the table of a keep matrix's candidate names, each placed and compared with the tensor with
no Mask, held to what mask.placed builds and to the tensor's cells written by a double loop."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.errors import MaskError
from maskcli.inspect.candidates import REFUSED, candidates, matching, profile, runs, same_each, stacked, table
from maskcli.inspect.composite import composites
from maskcli.intervals import Intervals
from maskcli.mask import MaskOptions, build, placed


def by_loop(rule, q_len: int, k_len: int, q_start: int) -> np.ndarray:
    """Bool (Lq, Lk): the rule at absolute query q_start + i and key k, cell by cell."""
    keep = np.zeros((q_len, k_len), dtype=bool)
    for i in range(q_len):
        for k in range(k_len):
            keep[i, k] = rule(q_start + i, k)
    return keep


RULES = {
    "window": lambda q, k: 0 <= q - k < 3,
    "causal": lambda q, k: k <= q,
    "sinks": lambda q, k: k <= q and (q - k < 2 or k < 1),
    "chunks": lambda q, k: k <= q and q // 3 == k // 3,
    "gaps": lambda q, k: (q + k) % 3 == 0,  # no kind: several runs a row
}


def placed_verdict(tree, options: dict, keep: np.ndarray):
    """What building the candidate's Mask says: its first batch row's cells are the tensor's, or refused (False)."""
    try:
        built = placed(tree, MaskOptions(**options))
    except MaskError:
        return False
    cells = built.dense()[0, 0]
    return cells.shape == keep.shape and bool(np.array_equal(np.broadcast_to(cells, keep.shape), keep))


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("q_len, k_len", [(8, 8), (3, 8)])
def test_every_candidate_matches_exactly_where_its_mask_is_the_tensor(name, q_len, k_len):
    keep = by_loop(RULES[name], q_len, k_len, k_len - q_len)
    at_end = k_len - q_len
    placements = [({"length": q_len, **({"offset": at_end} if at_end else {})}, at_end)]
    if at_end:
        placements.append(({"length": q_len, "kv_len": k_len}, 0))
    listed = [(term, options) for _, term, options in candidates(keep, placements, "attend")]
    if q_len == k_len:  # and masks of two kinds (StreamingLLM's sinks)
        listed += [(tree, {"length": q_len}) for _, tree in composites(profile(keep, 0, 0, "attend"), keep)]
    verdicts = matching(listed, keep.shape, runs(keep))
    for (tree, options), verdict in zip(listed, verdicts):
        assert verdict is not None, tree.text()  # one batch row, few intervals: the terms always say
        assert verdict == placed_verdict(tree, options, keep), (tree.text(), options)
    assert any(verdicts) == (name != "gaps" and (name != "sinks" or q_len == k_len))


@pytest.mark.parametrize("pad", [{"lengths": "5"}, {"lengths": "6", "pad": "left"}, {"ids": "1,1,0,1,1,1,1,1", "pad_id": 0}])
def test_a_padded_candidate_is_cut_by_its_padding_before_it_is_compared(pad):
    real = set(range(8))
    if "lengths" in pad:
        count = int(pad["lengths"])
        real = set(range(8 - count, 8)) if pad.get("pad") == "left" else set(range(count))
    else:
        real = {i for i, v in enumerate(pad["ids"].split(",")) if v != "0"}
    keep = by_loop(lambda q, k: k <= q and k in real, 8, 8, 0)
    listed = [(build("causal").expression, {"length": 8, **pad}), (build("full").expression, {"length": 8, **pad}),
              (build("causal").expression, {"length": 8})]
    verdicts = matching(listed, keep.shape, runs(keep))
    assert verdicts == [placed_verdict(tree, options, keep) for tree, options in listed] == [True, False, False]


def test_a_tensor_row_of_many_runs_matches_no_candidate_of_few_intervals():
    keep = np.zeros((4, 200), dtype=bool)
    keep[:, ::2] = True  # 100 runs a row: more than a row of intervals holds
    assert runs(keep) is None
    listed = [(build("full").expression, {"length": 4, "kv_len": 200}), (build("causal").expression, {"length": 4, "offset": 196})]
    assert matching(listed, keep.shape, None) == [False, False]


def test_table_refuses_where_placed_refuses_and_says_nothing_beyond_its_options():
    labels = build("document(0,0,1,1)").expression  # 4 labels
    found = table([(labels, {"length": 6}), (labels, {"length": 4}), (labels, {"length": 4, "tokens": "a b c d"}),
                   (build("causal").expression, {"length": 4, "lengths": "9"})])
    assert found[0] == REFUSED  # labels that do not cover 6 positions
    with pytest.raises(MaskError):
        placed(labels, MaskOptions(length=6))
    frame, got, cut = found[1]
    assert (frame.q_len, frame.k_len) == (4, 4) and cut is None
    assert np.array_equal(got.dense(0, 0, 4), placed(labels, MaskOptions(length=4)).dense()[0, 0])
    assert found[2] is None  # words: placed's to read
    assert found[3] == REFUSED  # a length past the sequence


def test_stacked_candidates_compare_each_as_a_dense_comparison_would():
    rng = np.random.default_rng(5)
    want_cells = rng.random((6, 10)) < 0.5
    want = runs(want_cells)
    rows = [want_cells.copy() for _ in range(5)]
    rows[1][2, 3] ^= True
    rows[3][:, 0] = ~rows[3][:, 0]
    found = [runs(cells) for cells in rows] + [Intervals.of(np.int64(0), np.int64(10), 0, 10)]  # one row for all
    same = same_each(stacked(found, 6, 10), want)
    expected = [bool(np.array_equal(cells, want_cells)) for cells in rows] + [bool(want_cells.all())]
    assert same.tolist() == expected == [True, False, True, False, True, False]


def test_candidates_their_kinds_rule_out_are_never_made_and_never_rebuild_the_tensor():
    # a window read the other way round: its queries see later keys and never themselves, so every causal kind and
    # every kind whose queries see themselves is ruled out before its intervals are made; a blocked diagonal does not
    from maskcli.inspect.candidates import RULED_OUT, lacking, ruled_out

    keep = by_loop(lambda q, k: not 0 <= q - k < 3, 8, 8, 0)
    listed = [(term, options) for _, term, options in candidates(keep, [({"length": 8}, 0)], "attend")]
    listed += [(tree, {"length": 8}) for _, tree in composites(profile(keep, 0, 0, "attend"), keep)]
    found = table(listed, runs(keep))
    from maskcli.terms import text

    out = [text(tree) for (tree, _), seen in zip(listed, found) if seen == RULED_OUT]
    assert {"causal", "full", "window(1)"} & set(out) and not any(text.startswith(("tril", "triu")) for text in out)
    for (tree, options), seen in zip(listed, found):
        if seen == RULED_OUT:
            assert placed_verdict(tree, options, keep) is False, text(tree)
    frame = table([(build("causal").expression, {"length": 8})])[0][0]
    assert lacking(runs(keep), frame, True) == {"causal", "sees_own", "sees_first"}
    assert lacking(runs(keep), frame, False) == {"causal"}  # key padding may cut a query's own key, never add a later one
    window = by_loop(lambda q, k: 0 <= q - k < 3, 8, 8, 0)
    assert lacking(runs(window), frame, True) == {"sees_first"}
    assert ruled_out(build("causal & window(2)").expression, frozenset({"sees_first"})) is False
    assert ruled_out(build("causal & (window(2) | sink(1))").expression, frozenset({"sees_first"})) is True  # sinks: key 0
    assert ruled_out(build("full | window(2)").expression, frozenset({"causal"})) is False


def test_a_kind_its_declarations_rule_out_at_a_placement_is_not_asked_for_candidates_there():
    # a window read the other way round: queries see later keys and not themselves, so no causal kind and no kind whose
    # queries see themselves is asked (the table would rule each out); asked without the rows, every kind is
    keep = by_loop(lambda q, k: not 0 <= q - k < 3, 12, 12, 0)
    place = [({"length": 12}, 0)]
    every = candidates(keep, place, "masked")
    asked = candidates(keep, place, "masked", rows=runs(keep))
    from maskcli.kinds import get as kind

    out = {name for name, _, _ in every} - {name for name, _, _ in asked}
    assert out and all(kind(name).causal or kind(name).sees_own or kind(name).sees_first for name in out)
    assert [item for item in every if item[0] not in out] == asked  # the rest as they were, in order
    # key padding may cut a query's own key and key 0: then only a later key seen rules a kind out
    cut = {name for name, _, _ in candidates(keep, place, "masked", rows=runs(keep), uncut=False)}
    assert {name for name in out if not kind(name).causal} <= cut and not cut & {name for name in out if kind(name).causal}


@pytest.mark.parametrize("cells", [1, 5, 1 << 22])
def test_profile_reads_each_rows_first_and_last_key_whatever_block_of_rows_it_reads(cells, monkeypatch):
    """profile's last visible key per row, read a block of rows at a time (inspect of a 20,000^2 tensor copied it
    whole), against a loop over each row's keys."""
    import maskcli.kinds.padding as module

    monkeypatch.setattr(module, "CELLS", cells)  # (the block of rows read at a time: padding.row_blocks)
    keep = np.random.default_rng(cells).random((9, 7)) < 0.4
    keep[3] = False
    got = profile(keep, 2, 5, "keep")
    for q, row in enumerate(keep):
        keys = [k for k in range(7) if row[k]]
        assert got.first[q] == (keys[0] if keys else 7) + 5 and got.last[q] == (keys[-1] if keys else -1) + 5
