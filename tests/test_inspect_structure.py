"""inspect/structure.py: candidates are built from their terms, and the text shown for each parses back to the same
cells; checked against masks made by a double loop over absolute positions."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.errors import MaskError
from maskcli.inspect.structure import REFUSED, candidates, on_terms, recognise
from maskcli.kinds import all_kinds
from maskcli.mask import MaskOptions, build, placed

C = [0, 0, 1, 1, 1, 2, 2, 2]
B = [-1, -1, 0, 0, 0, -1, 1, 1]
RULES = {  # kind: (what the reference keeps at absolute query q, key k, labels if any)
    "full": (lambda q, k: True, None),
    "causal": (lambda q, k: k <= q, None),
    "window": (lambda q, k: 0 <= q - k < 3, None),
    "prefix": (lambda q, k: k <= q or k < 3, None),
    "band": (lambda q, k: abs(q - k) < 2, None),
    "local": (lambda q, k: k <= q and q // 3 == k // 3, None),
    "chunk": (lambda q, k: C[k] <= C[q], C),
    "segment": (lambda q, k: C[k] == C[q], C),
    "document": (lambda q, k: k <= q and C[k] == C[q], C),
    "blocks": (lambda q, k: B[q] >= 0 and B[k] == B[q], B),
    "tril": (lambda q, k: k <= q - 1, None),
    "triu": (lambda q, k: k < q + 2, None),  # triu(2) with means=block: what it blocks is k >= q + 2
}


def reference(rule, q_len: int, k_len: int) -> np.ndarray:
    """Bool (Lq, Lk), the queries at the end of the keys, cell by cell."""
    start = k_len - q_len
    keep = np.zeros((q_len, k_len), dtype=bool)
    for i in range(q_len):
        for k in range(k_len):
            keep[i, k] = bool(rule(start + i, k))
    return keep


def placements(q_len: int, k_len: int):
    at_end = k_len - q_len
    base = {"length": q_len, **({"offset": at_end} if at_end else {})}
    return [(base, at_end)] + ([({"length": q_len, "kv_len": k_len}, 0)] if at_end else [])


def same_as_placed(tree, options: dict, built) -> None:
    """on_terms, where it answers, gives the frame and the cells of the Mask mask.placed builds (one batch row)."""
    seen = on_terms(tree, options)
    assert seen != REFUSED, (options, built.text)
    if seen is not None:
        frame, found = seen
        cells = found.dense(0, 0, frame.q_len)
        assert (frame.q_start, frame.q_len, frame.k_start, frame.k_len) == (
            built.frame.q_start, built.frame.q_len, built.frame.k_start, built.frame.k_len)
        assert built.batch == 1
        assert np.array_equal(cells, built.dense()[0, 0]), built.text


def candidate_kinds(kind: str, q_len: int) -> set[str]:
    """The kinds proposed for the reference of `kind`, each candidate's term and its printed text placed alike."""
    rule, labels = RULES[kind]
    k_len = len(labels) if labels else 8
    keep = reference(rule, q_len, k_len)
    seen = set()
    for name, term, options in candidates(keep, placements(q_len, k_len), "attend"):
        seen.add(name)
        try:
            from_text = build(term.text(), MaskOptions(**options))
        except MaskError:  # a candidate whose text is refused as typed is refused from its terms too
            with pytest.raises(MaskError):
                placed(term, MaskOptions(**options))
            assert on_terms(term, options) in (REFUSED, None)
            continue
        from_terms = placed(term, MaskOptions(**options))
        same_as_placed(term, options, from_terms)
        assert from_terms.text == term.text()
        place = lambda m: (m.frame.q_start, m.frame.q_len, m.frame.k_start, m.frame.k_len)  # noqa: E731
        assert place(from_terms) == place(from_text)
        assert np.array_equal(from_terms.dense(), from_text.dense()), term.text()
    return seen


@pytest.mark.parametrize("kind", sorted(RULES))
@pytest.mark.parametrize("q_len", [8, 3])
def test_every_candidate_term_and_its_text_make_the_same_mask(kind, q_len):
    candidate_kinds(kind, q_len)


def test_the_candidates_checked_cover_every_kind_that_recognises():
    seen = set().union(*(candidate_kinds(kind, q_len) for kind in RULES for q_len in (8, 3)))
    assert seen == {kind.name for kind in all_kinds() if kind.recognise is not None}


@pytest.mark.parametrize("kind", sorted(RULES))
@pytest.mark.parametrize("q_len", [8, 3])
def test_what_is_recognised_and_the_command_shown_rebuild_the_reference(kind, q_len):
    rule, labels = RULES[kind]
    k_len = len(labels) if labels else 8
    keep = reference(rule, q_len, k_len)
    if kind == "blocks" and q_len < k_len:
        pytest.skip("blocks alone over the last queries only: no kind rebuilds it (causal | blocks does)")
    found = recognise(keep[None, None])
    assert found.expression is not None, found.note
    assert np.array_equal(found.mask.dense()[0, 0], keep)
    again = build(found.expression, MaskOptions(**found.options))  # the command shown, as the user would type it
    assert np.array_equal(np.broadcast_to(again.dense()[0, 0], keep.shape), keep)


# --- composite.py: two-kind candidates, trees of terms -------------------------------------------------------------

D = [0, 0, 0, 1, 1, 1, 1, 2]
COMPOSITES = {  # kind at its heart: (what the reference keeps at query q, key k; the text the tree prints as)
    "document": (lambda q, k: D[k] == D[q] and 0 <= q - k < 2, "document(0,0,0,1,1,1,1,2) & window(2)"),
    "blocks": (lambda q, k: k <= q or (B[q] >= 0 and B[k] == B[q]), "causal | blocks(-1,-1,0,0,0,-1,1,1)"),
    "sink": (lambda q, k: k <= q and (q - k < 3 or k < 1), "causal & (window(3) | sink(1))"),
}


@pytest.mark.parametrize("kind", sorted(COMPOSITES))
def test_composites_are_trees_of_terms_that_rebuild_the_double_loop_and_print_as_text_that_parses_back(kind):
    from maskcli.inspect.composite import composites
    from maskcli.inspect.structure import profile
    from maskcli.terms import Term, terms, text

    rule, expected_text = COMPOSITES[kind]
    n = 8
    ref = np.array([[rule(q, k) for k in range(n)] for q in range(n)])
    found = {name: tree for name, tree in composites(profile(ref, 0, 0, "attend"), ref)}
    tree = found[kind]
    assert all(isinstance(term, Term) for term in terms(tree))  # bound to kinds: no text was parsed to make it
    assert text(tree) == expected_text
    assert np.array_equal(placed(tree, MaskOptions(length=n)).dense()[0, 0], ref)
    assert np.array_equal(build(text(tree), length=n).dense()[0, 0], ref)


def test_a_composite_whose_value_a_kind_refuses_is_no_candidate():
    """A sink of 0 leading keys (the last row's first run not at key 0) is refused by sink's check: not yielded."""
    from maskcli.inspect.composite import _kinds
    from maskcli.terms import bound_each

    assert bound_each([(_kinds()["sink"], {"sink": 0}), (_kinds()["window"], {"window": 3})])[0] is None
    assert bound_each([(_kinds()["window"], {"window": 3})])[0] is not None


# --- on_terms: a candidate compared on its terms, no Mask built -------------------------------------------------------


@pytest.mark.parametrize("text", ["causal", "window(2)", "sink(3)", "prefix(2)", "band(1)", "local(2)",
                                  "document(0,0,1,1,1,2)", "chunk(0,0,1,1,1,2)", "tree(-1,0,0)",
                                  "causal & (window(2) | sink(1))", "causal | blocks(-1,0,0,-1,1,1)"])
@pytest.mark.parametrize("length", [1, 3, 6])
@pytest.mark.parametrize("offset", [None, 0, 2])
@pytest.mark.parametrize("kv_len", [None, 6, 8])
@pytest.mark.parametrize("pad", [{}, {"lengths": "4"}, {"lengths": "5", "pad": "left"}, {"lengths": "9"},
                                 {"ids": "1,1,0,1,1,1", "pad_id": 0}])
def test_on_terms_is_placed_or_refused_as_placed_is(text, length, offset, kv_len, pad):
    """Over --len, --offset, --kv-len and the key padding: on_terms gives placed's frame and cells, or REFUSED
    exactly where placed refuses the candidate (a size its labels, its draft tree, its sinks or its padding do not
    fit)."""
    tree = build(text).expression  # the terms, bound once
    options = {"length": length, **({"offset": offset} if offset is not None else {}),
               **({"kv_len": kv_len} if kv_len is not None else {}), **pad}
    try:
        built = placed(tree, MaskOptions(**options))
    except MaskError:
        assert on_terms(tree, options) in (REFUSED, None)
        return
    same_as_placed(tree, options, built)


def test_on_terms_says_nothing_where_the_options_say_more_than_where_the_queries_sit():
    tree = build("causal", length=4).expression
    assert on_terms(tree, {"length": 4, "lengths": "4,2"}) is None  # two batch rows of key padding
    assert on_terms(tree, {"length": 4, "tokens": "a b c d"}) is None  # words: placed's to read
    assert on_terms(tree, {"offset": 2}) is None  # no --len: the data or the default says how many queries
    labels = build("document", params={"--chunks": "0,0,1;0,1,1"}).expression  # two batch rows of labels
    assert on_terms(labels, {"length": 3}) is None
    assert on_terms(build("causal", length=4).expression, {"length": 4, "heads": 2})[1].shape == (1, 4)


def test_runs_are_each_rows_cells_and_same_cells_compares_them_cell_for_cell():
    """runs against a double loop over a matrix with gaps, empty rows and full rows; same_cells against ==."""
    from maskcli.inspect.structure import runs, same_cells

    rng = np.random.default_rng(3)
    for _ in range(20):
        keep = rng.random((6, 9)) < 0.5
        keep[0] = False
        keep[1] = True
        found = runs(keep)
        assert found.shape == (1, 6)
        for q in range(6):
            expected, k = [], 0
            while k < 9:  # the row's runs of kept keys, by a loop
                if keep[q, k]:
                    end = k
                    while end < 9 and keep[q, end]:
                        end += 1
                    expected.append((k, end))
                    k = end
                else:
                    k += 1
            assert found.row(0, q) == expected
        other = keep.copy()
        other[rng.integers(6), rng.integers(9)] ^= True
        assert same_cells(runs(keep), found) and not same_cells(runs(other), found)
    assert runs(np.tile([True, False], (2, 200))) is None  # 200 runs in a row: not few, cells are compared
    sink = build("sink(1)", length=6).intervals()  # one row stored, standing for every row
    only_first = np.zeros((6, 6), dtype=bool)
    only_first[:, 0] = True
    assert same_cells(sink, runs(only_first))
    only_first[5, 1] = True
    assert not same_cells(sink, runs(only_first))


def test_a_single_query_over_several_identical_heads_is_read_as_its_key_padding():
    """A decode step's (B, H, 1, S) mask, its heads alike, with batch row 1's last two keys masked: key padding of
    lengths 8 and 6 (its rows against a double loop), where it raised on reshaping every head into one row per batch
    row. Heads that differ are no key padding: nothing is named, and nothing raises."""
    keep = np.ones((2, 3, 1, 8), bool)
    keep[1, :, :, 6:] = False
    found = recognise(keep)
    assert found.expression == "padding" and found.options["lengths"] == "8,6"
    cells = found.mask.dense()
    lengths = (8, 6)
    for b in range(2):
        for k in range(8):
            assert bool(cells[b, 0, -1, k]) == (k < lengths[b])
    keep[0, 1, :, 7] = False
    assert recognise(keep).expression is None


def test_a_recognised_term_of_whole_numbers_and_choices_prints_as_it_parses():
    """structure._parsed_alike does not parse such a term's text again: every recognised kind's, at values across
    each parameter's range (its least, small ones, the largest allowed), each choice, labels left at None."""
    import itertools

    from maskcli.expression import parse
    from maskcli.kinds.base import REQUIRED
    from maskcli.terms import Term, resolve

    checked = 0
    for kind in all_kinds():
        if kind.recognise is None:
            continue
        ranges = []
        for param in kind.params:
            if param.type == "int":
                low = -5 if param.minimum is None else param.minimum
                ranges.append([low, low + 1, 3, 7, 128, 1 << 40] + ([-(1 << 40), -1, 0] if param.minimum is None else []))
            elif param.type == "choice":
                ranges.append(list(param.choices))
            else:
                ranges.append([None] if param.default is not REQUIRED else [])
        for values in itertools.product(*ranges):
            term = Term(kind, tuple((p.name, p.check(v, kind.name) if p.type != "labels" else v) for p, v in zip(kind.params, values)))
            text = term.text()
            again, _ = resolve(parse(text), {}, text)
            assert again == term and again.text() == text, text
            checked += 1
    assert checked > 50


def test_a_term_that_fixes_no_length_is_placed_alike_without_len_only_at_the_default_length():
    """structure._placed_alike answers a term whose kind fixes no length without placing it again: as mask.placing
    places it without --len (and with --heads alone)."""
    from maskcli.inspect.structure import _placed_alike
    from maskcli.mask import placing
    from maskcli.terms import Term

    for kind in all_kinds():
        if kind.recognise is None or any(p.type == "labels" and p.default is not None for p in kind.params):
            continue
        term = Term(kind, tuple((p.name, p.default if p.type != "int" else max(p.minimum or 0, 1)) for p in kind.params))
        for q_len, heads in ((3, {}), (8, {}), (8, {"heads": 2}), (9, {})):
            try:
                built = placed(term, MaskOptions(length=q_len, **heads))
            except MaskError:
                continue
            try:
                frame = placing(term, MaskOptions(**heads))[0]
                alike = (frame.q_start, frame.q_len, frame.k_start, frame.k_len) == (
                    built.frame.q_start, built.frame.q_len, built.frame.k_start, built.frame.k_len)
            except MaskError:
                alike = False
            assert _placed_alike(term, heads, built) == alike, (term.text(), q_len)
