"""A draft tree's verification step (speculative decoding: Medusa, EAGLE, SpecInfer) against the tree the program states.

The verification call attends the T draft nodes, placed after the cached keys (draft node t at key column
Lk - T + t), and each node must see exactly itself and its ancestors among the draft keys. The model call
states the tree one of three ways, read in this order:

- `tree_parents` (T,) or (B, T): each node's parent index, -1 for the root: the ancestors are known, and the
  draft block must be exactly ancestor-or-self;
- `retrieve_indices` (paths, depth): each row one root-to-leaf path of node indices, padded with -1 (Medusa's
  and EAGLE's): the parents follow from consecutive entries;
- the depths alone: `tree_position_ids` / `position_offsets` (T,), or `position_ids` that repeat and start at the
  cache's length (each node's position is the cache length plus its depth, as Medusa and EAGLE pass them). The
  tree is not known, but a tree mask with these depths is: node i sees itself and exactly one node at each
  smaller depth, none at its own depth or deeper, and whatever a node it sees sees (an ancestor's ancestors).

A draft block that contradicts the stated tree is wrong: a node that misses an ancestor (part of the triangle
skipped) or sees a node that is not one (a sibling, a cousin). The cached keys before the draft are other rules'.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


TREE = ("tree_parents", "retrieve_indices", "tree_position_ids", "position_offsets", "position_ids")


def _flat(given, q_len: int) -> np.ndarray | None:
    """Int64 (T,) of a (T,) or (B, T) argument whose rows agree; None where it is not one."""
    if not isinstance(given, np.ndarray) or given.ndim not in (1, 2) or given.shape[-1] != q_len:
        return None
    rows = given.reshape(-1, q_len)
    return rows[0].astype(np.int64) if (rows == rows[:1]).all() else None


def _from_paths(paths: np.ndarray, q_len: int) -> np.ndarray | None:
    """Parents (T,) from retrieve_indices (paths, depth), -1 padded; None where they do not make one tree over T nodes."""
    if paths.ndim != 2 or paths.shape[1] < 1:
        return None
    parents = np.full(q_len, -2, dtype=np.int64)  # -2: no path names it yet
    child, parent = paths[:, 1:].reshape(-1), paths[:, :-1].reshape(-1)
    keep_ = child >= 0
    child, parent = child[keep_], parent[keep_]
    roots = paths[:, 0][paths[:, 0] >= 0]
    if (child >= q_len).any() or (parent < 0).any() or (roots >= q_len).any() or len(set(roots.tolist())) != 1:
        return None
    parents[roots[0]] = -1
    parents[child] = parent
    if (parents == -2).any():
        return None
    for c, p in zip(child.tolist(), parent.tolist()):  # (a few dozen nodes: paths that disagree are not one tree)
        if parents[c] != p:
            return None
    return parents


def _ancestors(parents: np.ndarray) -> np.ndarray | None:
    """Bool (T, T): node i's ancestors and itself; None where the parents are not a tree (a cycle, an index out of it)."""
    q_len = len(parents)
    if ((parents < -1) | (parents >= q_len)).any():
        return None
    found = np.eye(q_len, dtype=bool)
    hop = parents.copy()
    nodes = np.arange(q_len)
    for _ in range(q_len):  # one hop per level of the tree, over every node at once
        up = hop >= 0
        if not up.any():
            return found
        found[nodes[up], hop[up]] = True
        hop = np.where(up, parents[np.maximum(hop, 0)], -1)
    return None


def stated(top, q_len: int, k_len: int) -> tuple[str, np.ndarray | None, np.ndarray | None] | None:
    """(the argument, ancestors (T, T) or None, depths (T,) or None) of the tree the model call states for T nodes."""
    arguments = top.arguments
    parents = _flat(arguments.get("tree_parents"), q_len)
    if parents is not None:
        found = _ancestors(parents)
        return None if found is None else ("tree_parents", found, None)
    paths = arguments.get("retrieve_indices")
    if isinstance(paths, np.ndarray):
        parents = _from_paths(paths, q_len)
        found = None if parents is None else _ancestors(parents)
        if found is not None:
            return "retrieve_indices", found, None
    for name in ("tree_position_ids", "position_offsets"):
        depths = _flat(arguments.get(name), q_len)
        if depths is not None:
            depths = depths - depths.min()
            return (name, None, depths) if depths.max() > 0 and len(set(depths.tolist())) < q_len else None
    positions = _flat(arguments.get("position_ids"), q_len)
    if positions is not None and q_len < k_len and positions.min() == k_len - q_len == positions[0] \
            and (np.diff(positions) != 1).any() and (positions - positions[0]).max() < q_len:
        return "position_ids", None, positions - positions[0]
    return None


def _by_depths(draft: np.ndarray, depths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bool (B, T, T) cells of the draft block that no tree with these depths has, bool (B, T, D) depths below a node's
    own at which it sees no node): see the module's docstring."""
    q_len = len(depths)
    shallower = depths[None, :] < depths[:, None]
    self_ = np.eye(q_len, dtype=bool)
    bad = (draft & ~shallower & ~self_) | (~draft & self_)  # a node at its own depth or deeper; not itself
    level = np.eye(int(depths.max()) + 1, dtype=np.int64)[depths]  # (T, D): each node's depth, one-hot
    per_level = (draft & shallower).astype(np.int64) @ level  # (B, T, D): nodes seen at each depth
    below = np.arange(level.shape[1])[None, :] < depths[:, None]  # (T, D)
    bad |= draft & shallower & ((per_level > 1) @ level.T.astype(bool))  # two nodes of one depth: a non-ancestor
    seen = draft.astype(np.int64)
    bad |= ((seen @ seen) > 0) & ~draft  # i sees j and j sees k, but i does not see k: a skipped ancestor
    return bad, (per_level == 0) & below[None]


def siblings(call, own: np.ndarray, keys: np.ndarray) -> bool:
    """Whether the call's queries (at positions `own`, its key columns at positions `keys`) each see their own key and
    no other query's, in every batch row: one depth of a draft tree (EAGLE's top-k drafting, each step's top_k nodes
    attending their ancestors and themselves), nodes side by side, not consecutive tokens of one prompt, of which each
    sees the one before it."""
    if len(own) < 2:
        return False
    cells = keep(call)
    columns = [int(np.flatnonzero(keys == p)[0]) if (keys == p).any() else -1 for p in own.tolist()]
    if cells is None or min(columns) < 0:
        return False
    block = cells.any(axis=1)[:, :, columns]  # (B, Q, Q): the queries' own keys, over the heads
    return bool(np.array_equal(block, np.broadcast_to(np.eye(len(own), dtype=bool), block.shape)))


def check(run: Run) -> list:
    """Each verification call whose model call states a draft tree, against that tree."""
    found, done = [], set()
    if not any(name in top.arguments for top in run.tops for name in TREE):
        return found  # no model call states a tree or positions (most runs stop here)
    for call in run.calls:
        q_len, k_len = call.shape[2:]
        if call.stored is None or q_len < 2 or q_len > k_len or call.mask in done:
            continue
        top = run.top(call)
        if top is None:
            continue
        tree = stated(top, q_len, k_len)
        cells = None if tree is None else keep(call)
        if cells is None:
            continue
        done.add(call.mask)
        name, ancestors, depths = tree
        draft = cells.any(axis=1)[..., k_len - q_len:]  # (B, T, T): over the heads
        gaps = np.zeros(draft.shape[:2] + (1,), dtype=bool)
        bad = (draft != ancestors[None]) if ancestors is not None else None
        if bad is None:
            bad, gaps = _by_depths(draft, depths)
        if not bad.any() and not gaps.any():
            continue
        offset = k_len - q_len
        if bad.any():
            b, i, j = first_cell(bad)
            sees = bool(draft[b, i, j])
            twins = np.flatnonzero(draft[b, i] & (depths == depths[j]))[:6].tolist() if depths is not None else []
            if sees and len(twins) > 1 and depths[j] < depths[i]:
                what = (f"sees draft nodes {', '.join(map(str, twins))}, all at depth {int(depths[j])}: a node has one "
                        "ancestor at each depth, so it sees a node that is not one")
            else:
                what = f"{'sees' if sees else 'misses'} draft node {j}, " + (
                    "its ancestor" if ancestors is not None and ancestors[i, j] else "an ancestor of one it sees"
                    if not sees else "not its ancestor")
            cell = (b, offset + i, offset + j)
        else:
            b, i, d = first_cell(gaps)
            what, cell = f"sees no draft node at depth {d} (at depth {int(depths[i])}, it has one ancestor there)", None
        found.append((call, Finding("draft-tree", (
            f"draft node {i} of batch row {b} {what}, in the tree {name} states ({int(bad.sum() + gaps.sum())} such "
            f"cells): each node sees its ancestors and itself"),
            expected="ancestor-or-self over the draft tree", source=f"{name} of {top.where}", cell=cell)))
    return found


RULES = (
    Rule("draft-tree", "wrong", "steps", "a speculative-decoding draft tree's verification mask in which a node misses an "
         "ancestor or sees a node that is not one, the tree stated by tree_parents, retrieve_indices or the depths in "
         "its position_ids", check),
)
