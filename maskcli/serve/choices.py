"""EAGLE/Medusa-style choice lists: the draft tree a static speculative config names, as the parent array serve checks.

A choice list is a list of paths, each the child indices from the root ([[0], [0, 0], [1], ...]: Medusa's
medusa_choices, EAGLE's tree_choices, TensorRT-LLM's medusa_choices / eagle_choices). The verify step's
drafts are the root (node 0: the token the last step accepted, at position prefix) and one node per path,
ordered as Medusa's generate_medusa_buffers orders them (medusa/model/utils.py:45, sorted by depth, then
lexicographically), so node i here is node i of the engine's own medusa_attn_mask and medusa_position_ids.
EAGLE-1's generate_tree_buffers (SafeAILab/EAGLE eagle/model/utils.py:89-160) sorts and builds its tree_attn_mask
and tree_position_ids the same way; EAGLE-2's total_tokens trees are grown per step, so their masks carry them.
TensorRT-LLM takes the lists as MedusaDecodingConfig.medusa_choices / EagleDecodingConfig.eagle_choices
(tensorrt_llm/llmapi/llm_args.py, List[List[int]]: "Each sublist represents a path in the tree").
"""

from __future__ import annotations

import json

import numpy as np

from maskcli.errors import MaskError

NAMES = ("medusa_choices", "eagle_choices", "tree_choices")
FIX = "give a list of paths, each a list of child indices >= 0 from the root, every path's parent path listed too"


def parse(value, where: str) -> list[tuple[int, ...]]:
    """The paths of a choice list, refused in one line where it is no tree."""
    def said(item) -> str:
        return json.dumps(item)[:60]

    if not isinstance(value, list) or not value:
        raise MaskError(f"{where} is {said(value)}, not a non-empty list of paths; {FIX}")
    paths = []
    for item in value:
        if not isinstance(item, list) or not item or not all(type(c) is int for c in item):
            raise MaskError(f"{where} holds {said(item)}, which is no path (a non-empty list of ints); {FIX}")
        if min(item) < 0:
            raise MaskError(f"{where} holds {said(item)}, a negative child index; {FIX}")
        paths.append(tuple(item))
    seen = set()
    for path in paths:
        if path in seen:
            raise MaskError(f"{where} lists {said(list(path))} twice; list each path once")
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise MaskError(f"{where} holds {said(list(path))} but not its parent path {said(list(path[:-1]))}; {FIX}")
    return paths


def parents(paths: list[tuple[int, ...]]) -> np.ndarray:
    """int64 (len(paths) + 1,): node 0 the root (-1), then the paths sorted by (depth, path), each node's parent."""
    ordered = sorted(paths, key=lambda path: (len(path), path))
    node = {path: i + 1 for i, path in enumerate(ordered)}
    return np.array([-1] + [node.get(path[:-1], 0) for path in ordered], np.int64)


def path_of(paths: list[tuple[int, ...]], node: int) -> str:
    """How a message names draft `node`: the root, or its path in the choice list."""
    return "the root" if node == 0 else json.dumps(list(sorted(paths, key=lambda p: (len(p), p))[node - 1]))
