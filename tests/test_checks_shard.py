"""maskcli.checks.shard and shard.ranks: each rule on the bug it names, and quiet on the correct split.

The per-rank masks here are made as a context-parallel run makes them: PyTorch's _create_cp_block_mask reads the
mask_mod at (indices[local row of rank r's shard], indices[kv]) (_context_parallel/_attention.py:1250-1283);
the buggy ones skip that mapping, or pass is_causal=True (which PyTorch's ring attention requires with load
balancing, _context_parallel/_attention.py:405-406) instead of the layer's window.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor.experimental._attention import _PerDocumentHeadTailLoadBalancer

from maskcli import build
from maskcli.checks import shard as checks
from maskcli.checks.registry import rule, severity
from maskcli.shard import layouts, ranks, work


def dense(expr: str, length: int) -> np.ndarray:
    """The global mask by a double loop over absolute positions through its predicate."""
    mod = build(expr, length=length).mask_mod
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    return mod(torch.tensor(0), torch.tensor(0), q, k).numpy()


def rank_files(tmp_path, cells: np.ndarray, layout, *, local=False) -> list[str]:
    """Each rank's (slots, all slots) keep mask, on global positions through the layout's indices (or, with
    local=True, read at the local indices themselves: the bug)."""
    order = layout.indices()
    length = layout.length
    paths = []
    for r in range(layout.ranks):
        rows = layout.rank_indices(r)
        if local:
            rows = np.arange(rows.size)
            keys = np.arange(order.size)
        else:
            keys = order
        part = np.zeros((rows.size, order.size), dtype=bool)
        ok_r, ok_k = (rows >= 0) & (rows < length), (keys >= 0) & (keys < length)
        part[np.ix_(ok_r, ok_k)] = cells[np.ix_(rows[ok_r], keys[ok_k])]
        path = tmp_path / f"rank{r}.pt"
        torch.save(torch.from_numpy(part), path)
        paths.append(str(path))
    return paths


def codes(found):
    return [(f.code, f.rank) for f in found]


def test_the_correct_run_is_quiet(tmp_path):
    expr, layout = "causal & window(5)", layouts.headtail(32, 4)
    mask = build(expr, length=32)
    assert ranks.check(mask, layout, rank_files(tmp_path, dense(expr, 32), layout)) == []
    assert checks.coverage(layout) == []
    assert checks.imbalance(work.split(mask, layout)) == []


def test_a_rank_mask_on_local_indices_is_named(tmp_path):
    expr, layout = "causal", layouts.headtail(16, 2)
    found = ranks.check(build(expr, length=16), layout, rank_files(tmp_path, dense(expr, 16), layout, local=True))
    # rank 0 holds 0..3 and 12..15: on local indices its rows 4..7 read as positions 4..7, not 12..15
    assert codes(found) == [("shard-local-indices", 0), ("shard-local-indices", 1)]
    assert found[0].cell == (12, 4) and severity(found[0]) == "wrong"


def test_is_causal_replacing_a_window_under_cp_is_named(tmp_path):
    layout = layouts.headtail(32, 2)
    found = ranks.check(build("causal & window(4)", length=32), layout, rank_files(tmp_path, dense("causal", 32), layout))
    assert codes(found) == [("shard-is-causal", 0), ("shard-is-causal", 1)]
    assert found[0].cell == (4, 0)  # rank 0's first row that sees past the window: query 4 sees key 0


def test_tail_padding_that_drops_a_real_key_is_named(tmp_path):
    # 30 tokens over 2 x 4 chunks: padded to 32; a run that pads by masking the last 4 key slots (as if the
    # sequence ended at 28) hides the real keys 28 and 29
    expr, layout = "causal", layouts.headtail(30, 4)
    cells = dense(expr, 30)
    cells[:, 28:] = False
    found = ranks.check(build(expr, length=30), layout, rank_files(tmp_path, cells, layout))
    assert [f.code for f in found] == ["shard-dropped-key"]
    assert found[0].cell == (28, 28) and found[0].rank == 0
    assert "(and every key from 28 to 29, the last: padding or truncation cut the tail)" in found[0].message


def test_a_layout_that_truncates_the_tail_drops_real_tokens():
    # 30 tokens cut to 24 so that they divide into 2 x 4 chunks: tokens 24..29 are on no rank
    cut = layouts.from_indices(list(np.split(np.arange(24), 4)), 30, "cut")
    found = checks.coverage(cut)
    assert codes(found) == [("shard-dropped-token", None)]
    assert "6 real tokens on no rank, the first at position 24 (the tail" in found[0].message
    twice = layouts.from_indices([[0, 1], [1, 2, 3]], 4, "twice")
    found = checks.coverage(twice)
    assert codes(found) == [("shard-duplicate-token", 0)]
    assert "1 token held more than once, the first at position 1 (ranks 0, 1)" in found[0].message


def test_a_token_repeated_within_one_rank_names_that_rank_not_more_than_one():
    # a balancer's index file that writes token 6 twice on rank 0 and never token 5 (it said "on more than one rank (ranks 0)")
    found = checks.coverage(layouts.from_indices([[0, 1, 6, 6], [2, 3, 4, 7]], 8, "file"))
    assert codes(found) == [("shard-dropped-token", None), ("shard-duplicate-token", 0)]
    assert "1 real token on no rank, the first at position 5:" in found[0].message
    assert "1 token held more than once, the first at position 6 (2 times by rank 0)" in found[1].message


def test_pytorchs_per_document_order_is_valid_but_imbalanced():
    docs, n = [16, 16, 96], 2
    order = _PerDocumentHeadTailLoadBalancer([docs], n, "cpu")._generate_indices()[0].numpy()
    as_torch_shards = layouts.from_indices(list(np.split(order, n)), 128, "torch")
    expr = "document(sizes=[16,16,96])"
    mask = build(expr, length=128)
    assert checks.coverage(as_torch_shards) == []  # valid: every token on one rank
    # the work by a double loop: rank 0 holds the first 64 of the document-major order
    cells = dense(expr, 128)
    per_rank = [int(cells[order[r * 64:(r + 1) * 64]].sum()) for r in range(n)]
    split = work.split(mask, as_torch_shards)
    assert split.cells.tolist() == per_rank
    found = checks.imbalance(split)
    assert codes(found) == [("shard-imbalance", int(np.argmax(per_rank)))]
    assert f"{max(per_rank) / np.mean(per_rank):.3f}x the mean" in found[0].message
    # the same documents split as TransformerEngine (and the balancer's docstring) split them: balanced
    assert checks.imbalance(work.split(mask, layouts.per_document(docs, n))) == []


def test_padding_is_a_note():
    assert codes(checks.padding(layouts.headtail(30, 4))) == [("shard-padding", None)]
    assert checks.padding(layouts.headtail(32, 4)) == []


@pytest.mark.parametrize("layout", [layouts.headtail(16, 2), layouts.contiguous(16, 2)])
def test_a_part_that_sees_an_extra_key_is_wrong(tmp_path, layout):
    cells = dense("causal", 16)
    cells[5, 9] = True
    found = ranks.check(build("causal", length=16), layout, rank_files(tmp_path, cells, layout))
    assert [(f.code, f.cell) for f in found] == [("shard-extra-key", (5, 9))]


def test_uneven_ranks_are_suspicious():
    assert codes(checks.uneven(layouts.from_indices([[0, 1, 2], [3]], 4, "file"))) == [("shard-uneven", 0)]
    assert checks.uneven(layouts.headtail(30, 4)) == []  # padded: every rank 8 slots


def test_a_real_query_that_sees_a_padding_slot_is_wrong(tmp_path):
    # 6 tokens over 2 x 2 chunks of 2: rank 0 holds 0, 1 and the padding slots 6, 7 (gathered columns 2, 3)
    expr, layout = "causal", layouts.headtail(6, 2)
    paths = rank_files(tmp_path, dense(expr, 6), layout)
    part = torch.load(paths[1])
    part[0, 2] = True  # rank 1's first row (position 2) sees column 2: a padding slot
    torch.save(part, paths[1])
    found = ranks.check(build(expr, length=6), layout, paths)
    assert [(f.code, f.rank) for f in found] == [("shard-padding-seen", 1)]


def test_each_finding_takes_its_severity_from_its_rule_and_json_keeps_its_fields(tmp_path):
    """Every finding here is a maskcli.text.Finding with no severity of its own: its rule in the registry says it
    (wrong where the ranks compute another mask, suspicious where the split is valid but costly, a note for padding)."""
    import json

    from maskcli.render.shard import report_json
    from maskcli.shard.plan import analyse
    from maskcli.text import Finding

    expected = {"shard-dropped-token": "wrong", "shard-duplicate-token": "wrong", "shard-padding": "note",
                "shard-uneven": "suspicious", "shard-imbalance": "suspicious", "shard-local-indices": "wrong",
                "shard-is-causal": "wrong", "shard-padding-seen": "wrong", "shard-dropped-key": "wrong", "shard-extra-key": "wrong"}
    assert {code: rule(code).severity for code in expected} == expected
    assert {rule(code).reads for code in expected} == {"ranks"}
    made = (checks.coverage(layouts.from_indices([[0, 1, 1], [3, 4, 5]], 7, "file")) + checks.uneven(layouts.from_indices([[0, 1, 2], [3]], 4, "file"))
            + checks.padding(layouts.headtail(30, 4)))
    assert {f.code for f in made} == {"shard-dropped-token", "shard-duplicate-token", "shard-uneven", "shard-padding"}
    assert all(isinstance(f, Finding) and f.severity is None and severity(f) == expected[f.code] for f in made)
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps([[0, 1, 6, 7], [2, 3, 4, 5]]))  # 10 tokens cut to 8
    data = json.loads(report_json(analyse([("causal", build("causal", length=10))], str(cut), 2)))
    assert data["findings"] == [{"code": "shard-dropped-token", "severity": "wrong", "message": data["findings"][0]["message"],
                                 "rank": None, "cell": [8, 8]}]


@pytest.mark.parametrize("make", [lambda: layouts.contiguous(12, 2), lambda: layouts.headtail(13, 3),
                                  lambda: layouts.striped(13, 2, 2), lambda: layouts.per_document(np.array([5, 8]), 2)])
def test_what_each_rank_should_hold_is_read_through_the_ranks_source_in_pytorchs_order(tmp_path, make):
    """shard.ranks.gathered over the ranks source's runs: each rank's part as rank_files writes it from the double loop
    (its slots in local order, every slot in the gathered order, padding rows and columns empty)."""
    from maskcli.sources import registry

    layout = make()
    expr = "causal & window(4)"
    mask = build(expr, length=layout.length)
    held = registry.sources()["ranks"].load(layout, mask)
    order = layout.indices()
    keys = np.where(order < layout.length, order, -1)
    for r, path in enumerate(rank_files(tmp_path, dense(expr, layout.length), layout)):
        want = torch.load(path).numpy()
        assert np.array_equal(ranks.gathered(held[r], layout.rank_indices(r), keys), want), r
