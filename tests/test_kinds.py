"""The registry: every kind defined once, with what lists, explains, builds and recognises it."""

from __future__ import annotations

import importlib
import pkgutil
import shlex

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import definitions as ref
import maskcli.kinds as package
from maskcli.errors import MaskError
from maskcli.kinds import all_kinds, flags, get, names
from maskcli.kinds.base import Profile
from maskcli.mask import MaskOptions, build

KIND_NAMES = {"full", "causal", "tril", "triu", "window", "lookback", "band", "prefix", "sink", "local", "chunk", "document", "segment", "blocks", "tree", "padding"}


def test_every_kind_of_the_design_is_registered_once():
    assert set(names()) == KIND_NAMES
    assert len(names()) == len(set(names()))
    assert get("prefill") is get("causal")  # a name kept for causal behind an offset
    assert get("bidirectional") is get("full")  # Hugging Face's name (bidirectional_mask_function)


def test_the_registry_reads_every_kind_module():
    modules = [m.name for m in pkgutil.iter_modules(package.__path__) if m.name not in ("base", "values", "registry")]
    defined = [kind for name in modules for kind in importlib.import_module(f"maskcli.kinds.{name}").KINDS]
    assert sorted(k.name for k in defined) == sorted(names())


@pytest.mark.parametrize("kind", all_kinds(), ids=lambda k: k.name)
def test_each_kind_explains_itself_and_its_example_builds(kind):
    assert kind.meaning and kind.keep and kind.example
    for param in kind.params:
        assert param.help and param.flag.startswith("--") and param.type in ("int", "choice", "labels")
    options = {}
    words = shlex.split(kind.options)
    for flag, value in zip(words[::2], words[1::2]):
        options[{"--offset": "offset", "--lengths": "lengths", "--len": "length"}[flag]] = int(value) if flag != "--lengths" else value
    built = build(kind.example, MaskOptions(**options))
    assert kind.name in built.kinds
    assert built.dense().any()


def test_flags_are_shared_by_meaning_only():
    table = flags()
    assert {kind.name for kind, _ in table["--diagonal"]} == {"tril", "triu"}
    assert {kind.name for kind, _ in table["--chunks"]} == {"chunk", "document", "segment"}
    assert {kind.name for kind, _ in table["--sizes"]} == {"chunk", "document", "segment"}
    for flag, readers in table.items():
        assert len({param.type for _, param in readers}) == 1, flag


def test_unknown_names_suggest_the_nearest():
    with pytest.raises(MaskError, match="did you mean document?"):
        get("documnet")
    with pytest.raises(MaskError, match="the kinds are full, causal"):
        get("zzz")


def test_json_params_come_from_the_registry():
    assert build("window(3)").json()["params"] == {"window": 3}
    assert build("tril(-1)", length=3).json()["params"] == {"diagonal": -1, "means": "keep"}
    both = build("document(0,0,1,1) & window(2)").json()
    assert both["kind"] is None and [k["kind"] for k in both["kinds"]] == ["document", "window"]
    assert both["kinds"][0]["params"] == {"labels": [0, 0, 1, 1]}


CASES = [
    ("full", {}, 5),
    ("causal", {}, 5),
    ("window(2)", {"window": 2}, 6),
    ("lookback(2)", {"window": 2}, 6),
    ("lookback(4)", {"window": 4}, 6),
    ("band(2)", {"window": 2}, 6),
    ("prefix(3)", {"prefix": 3}, 6),
    ("sink(2)", {"sink": 2}, 6),
    ("local(3)", {"chunk_size": 3}, 7),
    ("tril(-1)", {"diagonal": -1, "means": "keep"}, 4),
    ("triu(1)", {"diagonal": 1, "means": "block"}, 4),
    ("triu(0, means=keep)", {"diagonal": 0, "means": "keep"}, 4),
]


@pytest.mark.parametrize(("text", "params", "length"), CASES)
@pytest.mark.parametrize("offset", [0, 3])
def test_positional_kinds_equal_their_definition_behind_an_offset(text, params, length, offset):
    name = text.split("(")[0]
    built = build(text, length=length, offset=offset or None)
    expected = ref.dense(("kind", name, params), q0=offset, lq=length, k0=0, lk=offset + length)
    assert built.dense()[:, 0].tolist() == expected


def test_label_kinds_equal_their_definition():
    labels = [[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]]
    for name in ("chunk", "document", "segment", "blocks"):
        built = build(f"{name}(0,0,1,1,1,2;0,1,1,2,2,2)")
        assert built.batch == 2
        assert built.dense()[:, 0].tolist() == ref.dense(("kind", name, {"labels": labels}), q0=0, lq=6, k0=0, lk=6, batch=2)


@pytest.mark.parametrize("offset", [0, 4])
def test_local_with_documents_equals_its_definition(offset):
    labels = [[0, 0, 0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]]
    text = ";".join(",".join(map(str, row)) for row in labels)
    for size in (1, 2, 3, 4):
        built = build(f"local({size}, documents=[{text}])", length=10 - offset, offset=offset or None)
        assert built.batch == 2 and built.exact
        expected = ref.dense(("kind", "local", {"chunk_size": size, "documents": labels}), q0=offset, lq=10 - offset, k0=0, lk=10, batch=2)
        assert built.dense()[:, 0].tolist() == expected
        assert built.materialize().numpy()[:, 0].tolist() == expected


def test_lookback_and_local_documents_check_their_parameters():
    with pytest.raises(MaskError, match=r"lookback\(0\): window must be at least 1"):
        build("lookback(0)", length=4)
    with pytest.raises(MaskError, match="have 3 entries but the mask covers positions 0-3"):
        build("local(2, documents=[0,0,1])", length=4)
    with pytest.raises(MaskError, match="batch rows do not agree"):
        build("local(2, documents=[0,0,1,1;0,1,1,1;1,1,1,1])", lengths="4,4")
@st.composite
def label_counts_cases(draw):
    """A same-label kind, labels (rows x n), where the queries and keys sit, key padding, and positions to count below."""
    name = draw(st.sampled_from(["document", "segment", "blocks"]))
    n = draw(st.integers(1, 12))
    rows = draw(st.integers(1, 2))
    labels = draw(st.lists(st.lists(st.integers(-1 if name == "blocks" else 0, 2), min_size=n, max_size=n), min_size=rows, max_size=rows))
    q_start, k_start = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
    q_len, k_len = (n - q_start, n - k_start) if draw(st.booleans()) else (draw(st.integers(1, n - q_start)), n - k_start)
    valid = draw(st.one_of(st.none(), st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=1, max_size=rows)))
    below = sorted(draw(st.lists(st.integers(k_start, k_start + k_len), min_size=1, max_size=5)))
    return name, labels, (q_start, q_len, k_start, k_len), valid, below


@settings(max_examples=300, deadline=None)
@given(label_counts_cases())
def test_same_label_kinds_count_their_keys_as_the_definition_does(case):
    from maskcli.kinds.base import Labels
    from maskcli.positions import Frame

    name, labels, (q0, lq, k0, lk), valid, below = case
    frame = Frame(q0, lq, k0, lk)
    array = np.array(labels, dtype=np.int64)
    counts = get(name).counts({"labels": Labels(array, "inline", "")}, frame, None if valid is None else np.array(valid))
    for b in range(max(len(labels), len(valid or [0]))):
        got = list(counts.keys_below(b, below))
        for x, row in zip(below, got):
            expected = [
                sum(ref.kind_keeps(name, {"labels": labels}, b, q, kv, {}) and (valid is None or ref._row(valid, b)[kv])
                    for kv in range(k0, x))
                for q in range(q0, q0 + lq)
            ]
            assert row.tolist() == expected, (b, x)


def test_many_image_blocks_keep_few_intervals():
    # Gemma 3 with many images: -1 (no block) comes back between every two blocks, yet each row has
    # at most one block's run of keys, so the intervals stay exact (not the cell-by-cell fallback)
    ids = ([-1] * 2 + [0] * 3) * 1 + sum(([-1] * 2 + [i] * 3 for i in range(1, 40)), [])
    text = ",".join(map(str, ids))
    built = build(f"causal | blocks({text})")
    assert built.exact, built.why_not_exact
    expected = ref.dense(("or", [("kind", "causal", {}), ("kind", "blocks", {"labels": [ids]})]), q0=0, lq=len(ids), k0=0, lk=len(ids))
    assert built.dense()[:, 0].tolist() == expected


def test_recognition_reads_parameters_that_rebuild_the_kind():
    """Each kind's candidates, read off its own cells, include parameters that rebuild it."""
    for text, length in (("window(3)", 8), ("prefix(3)", 8), ("local(3)", 9), ("chunk(0,0,1,1,2)", 5), ("tril(1)", 5), ("triu(2, means=keep)", 5)):
        built = build(text, length=length)
        cells = built.dense()[0, 0]
        positions = np.arange(length)
        profile = Profile(
            q=positions, first=np.where(cells, positions, length).min(1), last=np.where(cells, positions, -1).max(1),
            seen=cells.any(1), k_start=0, k_end=length, marked="attend",
        )
        kind = get(text.split("(")[0])
        rebuilt = []
        for params in kind.recognise(profile):
            from maskcli.terms import Term

            full = {p.name: params.get(p.name, p.default) for p in kind.params}
            rebuilt.append(Term(kind, tuple((p.name, full[p.name]) for p in kind.params)).text())
        assert any(np.array_equal(build(candidate, length=length).dense(), built.dense()) for candidate in rebuilt), (text, rebuilt)


def test_a_tree_whose_ancestor_lines_are_many_runs_is_drawn_from_a_dense_table():
    from torch.nn.attention.flex_attention import create_mask

    from maskcli.mask import build

    parents = [-1, -1] + [i - 2 for i in range(2, 140)]  # two interleaved chains: 70 runs per line
    mask = build("tree(" + ",".join(map(str, parents)) + ")", offset=3)
    assert not mask.exact
    expected = [[k < 3 or k - 3 in ref.ancestors_or_self(parents, q) for k in range(143)] for q in range(140)]
    assert mask.dense()[0, 0].tolist() == expected
    assert create_mask(mask.mask_mod, 1, 1, 140, 143, device="cpu")[0, 0].tolist() == expected


DECLARED = [  # an expression of each kind that declares what every query sees, at a few placements each
    "full", "causal", "window(1)", "window(3)", "lookback(1)", "lookback(4)", "prefix(1)", "prefix(5)", "sink(1)", "sink(3)",
    "local(1)", "local(3)", "band(1)", "band(3)", "chunk(2,2,0,0,1,1,5,5,3,3)", "document(1,1,0,0,0,2,2,2,2,2)",
    "segment(3,0,0,1,1,1,2,2,2,2)", "document(0,0,0,0,0,1,1,1,1,1) & local(2)",
]


@pytest.mark.parametrize("text", DECLARED)
@pytest.mark.parametrize("placement", [{"length": 10}, {"length": 4, "offset": 6}, {"length": 3, "offset": 2, "kv_len": 10}])
def test_what_a_kind_declares_every_query_sees_holds_cell_by_cell(text, placement):
    # recognition rules a kind out of a tensor that lacks what the kind declares (inspect/candidates.py's ruled_out):
    # each declaration read against the cells, query by query on absolute positions
    built = build(text, MaskOptions(**placement))
    cells, f = built.dense()[0, 0], built.frame
    kinds = [term.kind for term in built.expression.items] if hasattr(built.expression, "items") else [built.expression.kind]
    for i, q in enumerate(range(f.q_start, f.q_end)):
        row = {k for k in range(f.k_start, f.k_end) if cells[i, k - f.k_start]}
        if any(kind.causal for kind in kinds):
            assert max(row, default=-1) <= q, (text, q, row)
        if all(kind.sees_own for kind in kinds):
            assert q in row, (text, q, row)
        if all(kind.sees_first for kind in kinds):
            assert 0 in row, (text, q, row)
    declared = {kind.name for kind in all_kinds() if kind.sees_own or kind.sees_first}
    assert declared <= {"full", "causal", "window", "lookback", "prefix", "sink", "local", "band", "chunk", "document", "segment", "tree"}


def _profile(keep: np.ndarray):
    from maskcli.inspect.candidates import profile

    return profile(keep, 0, 0, "attend")


def test_the_label_kinds_make_no_candidate_whose_rows_see_keys_before_their_group():
    # a window's rows see the keys before them: no document, segment or blocks labels, and no chunk (its rows see from
    # key 0); packed documents and chunks still give theirs, their labels the ones the cells were written with
    n = 12
    window = np.array([[0 <= q - k < 3 for k in range(n)] for q in range(n)])
    for name in ("chunk", "document", "segment", "blocks"):
        assert list(get(name).recognise(_profile(window))) == [], name
    docs = [0] * 5 + [1] * 4 + [2] * 3
    packed = np.array([[docs[k] == docs[q] and k <= q for k in range(n)] for q in range(n)])
    [found] = get("document").recognise(_profile(packed))
    assert found["labels"].array[0].tolist() == docs and found["labels"].length == n and found["labels"].rows == 1
    chunks = np.array([[docs[k] <= docs[q] for k in range(n)] for q in range(n)])
    [found] = get("chunk").recognise(_profile(chunks))
    assert found["labels"].array[0].tolist() == docs


def test_recognised_asks_every_kind_once_and_makes_each_candidates_intervals_at_its_placement():
    """kinds.base.recognised: every candidate of one reading, bound and made at its frame in one call; each made
    candidate's cells are those of a double loop over absolute positions (q - 3 < kv <= q), and the order is the
    kinds' rank, then the placement, as recognition reads them."""
    from maskcli.intervals import Intervals
    from maskcli.kinds.base import NOT_MADE, recognised
    from maskcli.positions import Frame

    length = 10
    keep = np.array([[q - 3 < k <= q for k in range(length)] for q in range(length)])
    frame = Frame(0, length, 0, length)
    found = recognised(all_kinds(), [(0, _profile(keep), frozenset(), frame, frozenset())], 4096)
    assert [kind.rank for kind, *_ in found] == sorted(kind.rank for kind, *_ in found)
    window = [(checked, made) for kind, checked, _, made in found if kind.name == "window"]
    assert window == [((("window", 3),), window[0][1])]
    made = window[0][1]
    assert isinstance(made, Intervals)
    assert np.array_equal(made.dense(0, 0, length), keep)
    # asked to rule out what a kind holding "causal" would be (a later key seen): no causal kind's intervals made
    ruled = recognised(all_kinds(), [(0, _profile(keep), frozenset(), frame, frozenset({"causal"}))], 4096)
    assert all(made is NOT_MADE for kind, _, _, made in ruled if kind.causal)
    assert any(made is not NOT_MADE for kind, _, _, made in ruled if not kind.causal)
    # no frame: nothing made, the same candidates
    unmade = recognised(all_kinds(), [(0, _profile(keep), frozenset(), None, frozenset())], 4096)
    assert [(k.name, c) for k, c, _, _ in unmade] == [(k.name, c) for k, c, _, _ in found]
    assert all(made is NOT_MADE for *_, made in unmade)


def _runs_by_loop(row) -> list[tuple[int, int]]:
    """[start, end) of each run of True in `row`, walked key by key."""
    found, start = [], None
    for key, real in enumerate(list(row) + [False]):
        if real and start is None:
            start = key
        elif not real and start is not None:
            found.append((start, key))
            start = None
    return found


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=5).filter(
    lambda rows: len({len(row) for row in rows}) == 1), st.sampled_from([1, 3, 1 << 22]))
def test_key_runs_are_the_runs_a_loop_finds_whatever_block_of_rows_it_reads(rows, cells):
    """kinds.padding.key_runs (the padding kind's intervals, inspect's reading of a tensor's rows) against a walk key by
    key; `cells`: how many it compares at a time (a block of rows: one row, or every row at once)."""
    from types import SimpleNamespace

    import maskcli.kinds.padding as padding

    valid = np.array(rows, dtype=bool)
    kept = padding.CELLS
    padding.CELLS = cells
    try:
        got = padding.key_runs(valid, SimpleNamespace(k_start=0, k_end=valid.shape[1]))
    finally:
        padding.CELLS = kept
    for b, row in enumerate(valid):
        read = [(int(s), int(e)) for s, e in zip(got.starts[b, 0], got.ends[b, 0]) if s < e]
        assert read == _runs_by_loop(row)
