"""checks/grouped.py: a trace group as the rules given one read it, asked of the registry in the trace report's order
(its cells, what it was named, its scores, its kernel); the rows each rule names checked by a double loop over cells
written here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from maskcli import tracefile
from maskcli.checks import registry
from maskcli.checks.grouped import Grouped

GIVEN = ("cells", "named", "scores", "kernel")  # the order trace/report.py asks them in


def cells(q_len: int, k_len: int, keep) -> np.ndarray:
    """(1, 1, Lq, Lk) bool, cell by cell: keep(q, k) with the queries at the end of the keys."""
    out = np.zeros((1, 1, q_len, k_len), dtype=bool)
    for q in range(q_len):
        for k in range(k_len):
            out[0, 0, q, k] = keep(k_len - q_len + q, k)
    return out


def group(keep: np.ndarray, structure=None, flipped=None, run=None, **details) -> Grouped:
    call = SimpleNamespace(api="sdpa", shape=keep.shape, details=details, where="layers.0.attn", index=0, step=0)
    return Grouped([call], tracefile.from_dense(keep, keep.shape), structure, "the name", lambda: None, flipped, run)


def test_a_groups_rules_come_through_the_registry_in_the_reports_order():
    # queries 2..4 over keys 0..4: query 2 sees no key; query 3 sees key 4, after its own (one off causal)
    keep = cells(3, 5, lambda q, k: q > 2 and k <= q + 1)
    empty = [q for q in range(3) if not keep[0, 0, q].any()]
    later = [q for q in range(3) if any(keep[0, 0, q, k] for k in range(5) if k > 2 + q)]
    assert (empty, later) == ([0], [1])
    # named a raw tril(1), whose other reading is causal; is_causal with fewer queries than keys; a float mask's bias
    structure = SimpleNamespace(kind="tril", expression="tril(1)", closest=None)
    g = group(keep, structure, flipped=lambda: ("causal", "causal"), is_causal=True, bias=True)
    found = [(given, f.code) for given in GIVEN for f in registry.run(given, g)]
    assert found == [("cells", "fully-masked"), ("cells", "sees-later"), ("named", "polarity"), ("scores", "bias"),
                     ("kernel", "top-left-causal")]
    [fully, sees] = registry.run("cells", g)
    assert "query row 0 sees no key" in fully.message and "query rows 1 see later keys" in sees.message


def test_a_group_kept_as_counts_has_only_its_empty_rows_read_and_a_named_one_no_closest():
    stored = tracefile.stats_only((1, 1, 4, 4), 6, 1, "past --max-bytes")
    call = SimpleNamespace(api="sdpa", shape=(1, 1, 4, 4), details={}, where="attn", index=0, step=0)
    [found] = registry.run("cells", Grouped([call], stored))
    assert found.code == "fully-masked" and found.message.startswith("1 query rows see no key")
    assert registry.run("named", Grouped([call], stored)) == []  # not named: no structure to read
    causal = cells(4, 4, lambda q, k: k <= q)
    named = SimpleNamespace(kind="causal", expression="causal", closest=None)
    assert [registry.run(given, group(causal, named, flipped=lambda: ("triu", "triu(1)"))) for given in GIVEN] == [[]] * 4


def test_where_the_model_calls_state_the_queries_is_worked_out_once_a_group():
    asked = []

    def top(call):
        asked.append(call.index)
        return SimpleNamespace(arguments={"start_pos": 8})

    g = group(cells(2, 4, lambda q, k: True), run=SimpleNamespace(top=top))
    assert g.past is True and g.past is True and asked == [0]  # every key precedes the queries stated at 8
