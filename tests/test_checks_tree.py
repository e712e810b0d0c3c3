"""checks/tree.py: a speculative draft tree's verification mask against the tree the model call states, on programs
written as Medusa / EAGLE / SpecInfer-style code writes them (tests/data/rows), against a double loop over nodes."""

from __future__ import annotations

import numpy as np

from checkbugs import caught, check_bug, first
from maskcli.checks.tree import _ancestors, _from_paths


def _ancestor(parents, i, j):
    """j is i or one of its ancestors, walking the parents one by one."""
    while i >= 0:
        if i == j:
            return True
        i = parents[i]
    return False


def test_a_tree_mask_that_walks_one_hop_up_the_stated_parents_is_found(tmp_path):
    hit = caught(tmp_path, "draft_tree_one_hop", ("draft-tree",))
    parents = [-1, 0, 0, 1, 1, 2, 3]
    seen = lambda i, j: i == j or parents[i] == j  # noqa: E731 - the program's mask: itself and its parent
    b, i, j = first((1, 7, 7), lambda b, i, j: seen(i, j) != _ancestor(parents, i, j))
    assert tuple(hit["cell"]) == (b, 4 + i, 4 + j)  # 4 prompt keys in the cache before the draft


def test_a_tree_mask_built_from_depths_alone_is_found_by_the_depths_in_position_ids(tmp_path):
    hit = caught(tmp_path, "draft_tree_by_depth", ("draft-tree",))
    depth = [0, 1, 1, 2, 2, 2]
    parents = [-1, 0, 0, 1, 1, 2]  # the tree retrieve_indices makes
    seen = lambda i, j: i == j or depth[j] < depth[i]  # noqa: E731 - the program's mask
    b, i, j = first((1, 6, 6), lambda b, i, j: seen(i, j) and not _ancestor(parents, i, j))
    # depths alone cannot say which of two nodes at one depth is the ancestor: the node, and the depth, are
    assert hit["cell"][:2] == [b, 5 + i] and depth[hit["cell"][2] - 5] == depth[j]


def test_ancestors_from_parents_and_from_retrieve_indices_match_a_walk_up_the_tree():
    parents = np.array([-1, 0, 0, 1, 1, 2])
    found = _ancestors(parents)
    assert found.tolist() == [[_ancestor(parents.tolist(), i, j) for j in range(6)] for i in range(6)]
    paths = np.array([[0, 1, 3], [0, 1, 4], [0, 2, 5]])
    assert _from_paths(paths, 6).tolist() == parents.tolist()
    assert _ancestors(np.array([1, 0])) is None  # a cycle is no tree


def test_angelslim_eagle3_tree_mask_one_column_right_of_the_draft_keys(tmp_path):
    """Tencent/AngelSlim#62 (written blind, caught before any rule was changed for it): the verify step's tree mask
    written one column right of the draft keys; nodes see a sibling and not themselves. The fix is quiet."""
    found = check_bug(tmp_path, "angelslim_eagle3_qwen3_tree_mask_target_length_plus_one", "draft-tree")
    assert "not its ancestor" in found[0]["message"] and "position_ids" in found[0]["message"]


def test_siblings_are_a_step_whose_queries_see_only_their_own_keys(monkeypatch):
    """A draft depth of top_k nodes side by side (EAGLE's top-k drafting) against a chunk of a prompt: each node sees
    the prompt, its ancestors and itself, none of the nodes drafted with it; a chunk's token sees the one before it."""
    from types import SimpleNamespace

    import maskcli.checks.tree as tree

    monkeypatch.setattr(tree, "keep", lambda call: call.stored)
    own, keys = np.arange(9, 12), np.arange(12)
    depth = np.zeros((1, 2, 3, 12), dtype=bool)
    depth[..., :7] = True  # the prompt and an ancestor
    for i in range(3):
        depth[..., i, 9 + i] = True  # itself (a double loop: no other node of its depth)
    assert tree.siblings(SimpleNamespace(stored=depth), own, keys)
    chunk = np.tril(np.ones((12, 12), dtype=bool))[None, None, 9:]
    assert not tree.siblings(SimpleNamespace(stored=chunk), own, keys)
    assert not tree.siblings(SimpleNamespace(stored=depth[..., :1, :]), own[:1], keys)  # one query: nothing to tell
