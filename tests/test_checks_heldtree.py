"""checks/heldtree.py: a draft tree's verify attention whose rows over the draft keys are not the tree mask the program
hands the kernel, caught in the published bug's reproduction (tests/data/bugs) and in a program written another way
(tests/data/heldtree), quiet on both fixes; the flagged cells against a walk up the tree."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import check_bug
from maskcli.checks import heldtree
from test_checks_tree import _ancestor  # (a walk up the tree, the reference of both files)

HELDTREE = Path(__file__).parent / "data" / "heldtree"


def test_fastdeploy_mask_check_iteration_skips_the_lower_triangle_tiles_is_found(tmp_path):
    # PaddlePaddle/FastDeploy#3514: mask_check_iteration = kv_len - q_len + tile_id * rows / GROUP_SIZE, so the second
    # query tile's KV tiles below its diagonal were never masked; the fix starts at kv_len - q_len for every tile
    found = check_bug(tmp_path, "fastdeploy_append_attention_tree_mask_check_skips_lower_triangle_tiles",
                      "tree-mask-not-applied")
    assert len(found) == 1
    parents = [-1, 0, 0, 1, 1, 2, 2, 3]
    # the second tile's first query is node 4, which sees node 2 (a sibling of its parent): 8 cache keys before the draft
    assert not _ancestor(parents, 4, 2) and tuple(found[0]["cell"]) == (0, 0, 8 + 2)
    assert "draft node 4" in found[0]["message"] and "`tree_mask`" in found[0]["message"]


def test_medusa_tree_mask_on_diagonal_kv_blocks_only_is_found(tmp_path):
    found = check_bug(tmp_path, "medusa_tree_verify_tree_mask_on_diagonal_kv_blocks_only", "tree-mask-not-applied",
                      folder=HELDTREE)
    parents = [-1, 0, 0, 1, 2, 1, 3, 4]
    assert not _ancestor(parents, 4, 1) and tuple(found[0]["cell"]) == (0, 0, 6 + 1)  # node 4 sees node 1
    assert "`spec_tree_mask`" in found[0]["message"]


def _cells(parents, rows, prefix, leak):
    """(1, 1, len(rows), prefix + T) keep of a verify tile over draft nodes `rows`: the cache, then each node's ancestors
    and itself, and every earlier draft node where `leak` (a double loop over nodes)."""
    t = len(parents)
    cells = np.zeros((1, 1, len(rows), prefix + t), dtype=bool)
    for r, i in enumerate(rows):
        cells[0, 0, r, :prefix] = True
        for j in range(t):
            cells[0, 0, r, prefix + j] = _ancestor(parents, i, j) or (leak and j < i)
    return cells


def test_judged_against_a_walk_up_the_tree(monkeypatch):
    monkeypatch.setattr(heldtree, "keep", lambda call: call.stored)
    parents = [-1, 0, 0, 1, 1, 2, 2, 3]
    tree = np.array([[_ancestor(parents, i, j) for j in range(8)] for i in range(8)])
    held = {"name": "tree_mask", "where": "kernel()", "rows": tree}
    for rows in (range(0, 4), range(4, 8), range(0, 8)):
        right = _cells(parents, list(rows), 5, leak=False)
        assert heldtree._judged(SimpleNamespace(stored=right, shape=right.shape), held) is None
        wrong = _cells(parents, list(rows), 5, leak=True)
        expected = sum(1 for i in rows for j in range(i) if not _ancestor(parents, i, j))
        found = heldtree._judged(SimpleNamespace(stored=wrong, shape=wrong.shape), held)
        assert f"({expected} such cells)" in found.message
    # a mask not named as a tree is not read
    assert heldtree._judged(SimpleNamespace(stored=wrong, shape=wrong.shape), {**held, "name": "x_mask"}) is None
    # the mask handed the other way round (True = hidden) is the same tree
    assert heldtree._tree(~tree) is not None and (heldtree._tree(~tree) == tree).all()
    assert heldtree._tree(np.ones((4, 4), dtype=bool)) is None  # a node seeing a later one: no tree in order


def test_the_tree_handed_nearest_the_call_is_read_not_one_a_caller_further_out_holds(tmp_path):
    """OPT-Tree's classic verifier (written blind, quiet-r133a; a false alarm before) written another way: verify() holds
    the tree it checked and drafts the next one, whose kernel is handed that tree's own `tree_mask`. Quiet: the outer
    tree is another tree's. `--leak`: the kernel lays a causal triangle over the draft instead, contradicting the tree
    it was handed (each node sees every earlier node): said against that tree, for both trees' calls."""
    from checkbugs import traced

    name = "verify_holds_its_tree_while_drafting_the_next"
    status, found, report = traced(tmp_path, name, False, HELDTREE)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    status, found, report = traced(tmp_path, name, False, HELDTREE, ("--leak",))
    said = [f for f in found if f["code"] == "tree-mask-not-applied"]
    for parents in ([-1, 0, 0, 1, 1, 2, 3], [-1, 0, 0, 1, 2]):
        leaks = sum(1 for i in range(len(parents)) for j in range(i) if not _ancestor(parents, i, j))
        assert [f for f in said if f"({leaks} such cells)" in " ".join(f["message"].split())
                and "(tree_attention() of" in " ".join(f["message"].split())], (leaks, report)
