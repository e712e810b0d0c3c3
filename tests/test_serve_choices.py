"""serve's choice lists (maskcli/serve/choices.py): Medusa/EAGLE paths read as the tree every draft mask must be.

The reference is Medusa's own generate_medusa_buffers (github FasterDecoding/Medusa at e2a5d20,
medusa/model/utils.py:32-125), its attention mask and position ids rewritten below as Medusa wrote them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.errors import MaskError
from maskcli.serve import choices
from maskcli.checks.serve import check
from maskcli.serve.engines import from_tensors
from serve_builders import Req, allocate, with_tree

TREE_ENGINES = ("flashinfer", "sglang", "trtllm")

# Medusa's medusa/model/medusa_choices.py:1 (the default tree of Medusa-1 Vicuna 7B)
MC_SIM_7B_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
                [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9],
                [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1],
                [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0],
                [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
                [0, 0, 0, 1], [1, 6], [0, 7, 0]]


def medusa_buffers(medusa_choices):
    """medusa_attn_mask (n, n) and medusa_position_ids (n,), as medusa/model/utils.py:45-89 computes them."""
    import torch

    sorted_medusa_choices = sorted(medusa_choices, key=lambda x: (len(x), x))  # utils.py:45
    medusa_len = len(sorted_medusa_choices) + 1
    depth_counts = []  # utils.py:49-56
    prev_depth = 0
    for path in sorted_medusa_choices:
        depth = len(path)
        if depth != prev_depth:
            depth_counts.append(0)
        depth_counts[depth - 1] += 1
        prev_depth = depth
    medusa_attn_mask = torch.eye(medusa_len, medusa_len)  # utils.py:59-72
    medusa_attn_mask[:, 0] = 1
    start = 0
    for i in range(len(depth_counts)):
        for j in range(depth_counts[i]):
            cur_medusa_choice = sorted_medusa_choices[start + j]
            if len(cur_medusa_choice) == 1:
                continue
            ancestor_idx = []
            for c in range(len(cur_medusa_choice) - 1):
                ancestor_idx.append(sorted_medusa_choices.index(cur_medusa_choice[:c + 1]) + 1)
            medusa_attn_mask[j + start + 1, ancestor_idx] = 1
        start += depth_counts[i]
    medusa_position_ids = torch.zeros(medusa_len, dtype=torch.long)  # utils.py:85-89
    start = 0
    for i in range(len(depth_counts)):
        medusa_position_ids[start + 1: start + depth_counts[i] + 1] = i + 1
        start += depth_counts[i]
    return medusa_attn_mask.bool().numpy(), medusa_position_ids.numpy()


def verify_batch(engine, paths, prefix=7, cells=None, positions=None, name="medusa_choices"):
    """A batch whose last request verifies the tree with the engine's mask from Medusa's buffers (tree_decoding's
    position_ids = medusa_position_ids + the cached length, utils.py:333), the choice list in the file."""
    mask, ids = medusa_buffers(paths)
    n = len(ids)
    # SGLang's verify batch gives every request the same number of drafts (serve_builders.sglang_verify makes the
    # others chains): with a static tree every request verifies it, so the tree request is alone there
    reqs = allocate(([] if engine == "sglang" else [Req(3, 1)]) + [Req(prefix, n)], 4)
    if cells is None:
        cells = np.concatenate([np.ones((n, prefix), bool), mask], 1)
    positions = prefix + ids if positions is None else positions
    tensors = with_tree(engine, reqs, 4, list(range(-1, n - 1)), cells=cells, positions=positions)  # parents: n only
    return from_tensors(tensors | {name: paths}, "batch"), cells, prefix


def served(paths):
    """serve's tree for a choice list: its mask among the drafts and each node's depth."""
    from maskcli.kinds.tree import ancestor_table
    from maskcli.serve.trees import Tree

    parents = choices.parents(choices.parse(paths, "paths"))
    return ancestor_table(parents), Tree(parents, 0, None).depth


@pytest.mark.parametrize("engine", TREE_ENGINES)
def test_mc_sim_7b_63_is_the_tree_medusa_buffers_make(engine):
    mask, ids = medusa_buffers(MC_SIM_7B_63)
    tree, depth = served(MC_SIM_7B_63)
    assert mask.shape == (64, 64) and (tree != mask).sum() == 0
    assert np.array_equal(depth, ids)
    batch, cells, prefix = verify_batch(engine, MC_SIM_7B_63)
    assert (batch.mask(batch.requests - 1).intervals().dense(0, 0, 64) != cells).sum() == 0
    assert check(batch) == []


@st.composite
def choice_lists(draw):
    """Random trees as paths: each new path one child index (0..9) under the root or a path drawn before, listed in
    a shuffled order."""
    paths = []
    for _ in range(draw(st.integers(1, 30))):
        under = draw(st.sampled_from([()] + paths))
        path = under + (draw(st.integers(0, 9)),)
        if path not in paths:
            paths.append(path)
    return [list(path) for path in draw(st.permutations(paths))]


@settings(max_examples=60, deadline=None)
@given(choice_lists(), st.sampled_from(TREE_ENGINES))
def test_random_choice_lists_are_the_tree_medusa_buffers_make(paths, engine):
    mask, ids = medusa_buffers(paths)
    tree, depth = served(paths)
    assert (tree != mask).sum() == 0, paths
    assert np.array_equal(depth, ids), paths
    batch, _, _ = verify_batch(engine, paths)
    assert check(batch) == [], paths


@pytest.mark.parametrize("engine", TREE_ENGINES)
def test_a_node_that_sees_its_sibling_is_reported_with_its_path(engine):
    paths = [[0], [1], [0, 0], [0, 1], [1, 0]]  # nodes: root, [0], [1], [0, 0], [0, 1], [1, 0]
    mask, _ = medusa_buffers(paths)
    prefix = 7
    cells = np.concatenate([np.ones((6, prefix), bool), mask], 1)
    cells[4, prefix + 3] = True  # [0, 1] sees [0, 0], its sibling
    batch, _, _ = verify_batch(engine, paths, prefix, cells=cells)
    found = check(batch)
    assert [(f.code, f.cell) for f in found] == [("tree-mask", (prefix + 4, prefix + 3))]
    assert found[0].message == (f"request {batch.requests - 1}'s draft node 4 ([0, 1] in medusa_choices) sees draft 3, which is not its "
                                "ancestor (draft 3 is [0, 0]): a tree node sees the prefix, its ancestors and itself")


@pytest.mark.parametrize("engine", TREE_ENGINES)
def test_a_mask_of_another_tree_is_reported_though_it_is_a_tree(engine):
    """The file's mask is a well-formed tree, but not the choice list's: [1, 0] hangs under [0] in the mask."""
    mask, _ = medusa_buffers([[0], [1], [0, 0], [0, 1]])  # node 4 = [0, 1], under node 1
    batch, _, prefix = verify_batch(engine, [[0], [1], [0, 0], [1, 0]], cells=None)
    assert check(batch) == []
    batch, _, _ = verify_batch(engine, [[0], [1], [0, 0], [1, 0]], prefix, cells=np.concatenate([np.ones((5, prefix), bool), mask], 1))
    found = check(batch)
    # node 4 ([1, 0]) sees draft 1 ([0]) where the choice list puts it under draft 2 ([1])
    assert [(f.code, f.cell) for f in found] == [("tree-mask", (prefix + 4, prefix + 1))]


@pytest.mark.parametrize("engine", ("sglang", "trtllm"))  # FlashInfer's plan() takes no positions
def test_positions_not_prefix_plus_depth_are_reported(engine):
    paths = [[0], [1], [0, 0]]
    prefix = 7
    chain = prefix + np.arange(4)  # node 2 ([1], depth 1) at prefix + 2
    found = check(verify_batch(engine, paths, prefix, positions=chain)[0])
    assert [(f.code, f.cell) for f in found] == [("positions", (prefix + 2, 0))]
    assert "has position 9; its mask puts it at 8 (prefix + depth)" in found[0].message


def test_a_verify_step_with_another_number_of_drafts_is_reported():
    found = check(from_tensors(_tensors([[0], [1]]), "batch"))
    assert [(f.code, f.message) for f in found] == [
        ("tree-mask", "request 1 verifies 4 drafts; tree_choices makes 3 (the root and 2 paths)")]


@pytest.mark.parametrize("engine", TREE_ENGINES)
def test_a_chain_of_another_length_is_a_verify_request_off_its_tree_but_in_flashinfer(engine):
    """A 3-draft chain where the choice list makes 4 nodes: in TensorRT-LLM's and SGLang's fields only verify
    requests hold a tree mask, so it is reported; FlashInfer's custom_mask holds every request, a plain causal
    prefill too, so there it is not."""
    reqs = allocate([Req(5, 3)], 4)
    tensors = with_tree(engine, reqs, 4, [-1, 0, 1]) | {"medusa_choices": [[0], [1], [0, 0]]}
    found = check(from_tensors(tensors, "batch"))
    want = [] if engine == "flashinfer" else [
        ("tree-mask", "request 0 verifies 3 drafts; medusa_choices makes 4 (the root and 3 paths)")]
    assert [(f.code, f.message) for f in found] == want


def _tensors(batch_paths):
    mask, ids = medusa_buffers([[0], [1], [0, 0]])
    reqs = allocate([Req(3, 1), Req(7, 4)], 4)
    cells = np.concatenate([np.ones((4, 7), bool), mask], 1)
    return with_tree("trtllm", reqs, 4, [-1, 0, 0, 1], cells=cells, positions=7 + ids) | {"tree_choices": batch_paths}


@pytest.mark.parametrize("value, said", [
    ([[0], [0, 0, 1]], "holds [0, 0, 1] but not its parent path [0, 0]"),
    ([[0], [1], [0]], "lists [0] twice"),
    ([[0], [-1]], "holds [-1], a negative child index"),
    ([[0], 1], "holds 1, which is no path (a non-empty list of ints)"),
    ([[0], [0.5]], "holds [0.5], which is no path (a non-empty list of ints)"),
    ([[0], []], "holds [], which is no path (a non-empty list of ints)"),
    ([], "is [], not a non-empty list of paths"),
    ({"a": [0]}, 'is {"a": [0]}, not a non-empty list of paths'),
])
def test_a_bad_choice_list_is_one_line_and_exit_2(tmp_path, value, said):
    tensors = _json(_tensors([[0]]))
    del tensors["tree_choices"]
    path = tmp_path / "b.json"
    path.write_text(json.dumps(tensors | {"eagle_choices": value}))
    result = CliRunner().invoke(app, ["serve", str(path)], env={"COLUMNS": "120"})
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(f"maskcli: error: '{path}': eagle_choices {said}; ")
    assert result.stderr.count("\n") == 1


def _json(tensors) -> dict:
    return {k: (np.asarray(v).tolist() if not isinstance(v, list) else v) for k, v in tensors.items()}


def test_two_choice_lists_or_one_without_a_tree_mask_are_refused():
    with pytest.raises(MaskError, match="'batch' holds medusa_choices, tree_choices: give one choice list"):
        from_tensors(_tensors([[0], [1]]) | {"medusa_choices": [[0]]}, "batch")
    with pytest.raises(MaskError, match="holds medusa_choices but no draft tree's mask to check it against"):
        from_tensors({"query_start_loc": [0, 1], "seq_lens": [4], "medusa_choices": [[0]]}, "batch")


@pytest.mark.parametrize("suffix", [".json", ".pt"])
def test_serve_reads_a_choice_list_from_a_field_file(tmp_path, suffix):
    import torch

    path = tmp_path / f"verify{suffix}"
    tensors = _json(_tensors([[0], [1], [0, 0]]))
    if suffix == ".pt":  # the engine's tensors, the choice list a plain (ragged) list as the config holds it
        torch.save({k: v if k == "tree_choices" else torch.tensor(v) for k, v in tensors.items()}, path)
    else:
        path.write_text(json.dumps(tensors))
    result = CliRunner().invoke(app, ["serve", str(path)], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    for expected in ("1     7-10      0-10   tree(-1,0,0,1)",
                     "note: draft trees checked against tree_choices: the root and 3 paths, ordered by depth then path",
                     "no findings: the lengths, pages, writes and masks agree"):
        assert expected in lines, (expected, lines)


def test_serve_reports_a_draft_mask_off_its_choice_list(tmp_path):
    paths = [[0], [1], [0, 0], [1, 0]]
    mask, ids = medusa_buffers(paths)
    mask[4, 3] = True  # [1, 0] sees [0, 0], its parent's sibling's child
    reqs = allocate([Req(3, 1), Req(7, 5)], 4)
    tensors = with_tree("trtllm", reqs, 4, list(range(-1, 4)), cells=np.concatenate([np.ones((5, 7), bool), mask], 1),
                        positions=7 + ids)
    path = tmp_path / "verify.json"
    path.write_text(json.dumps(_json(tensors) | {"eagle_choices": paths}))
    result = CliRunner().invoke(app, ["serve", str(path)], env={"COLUMNS": "120"})
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[-2:] == [
        "• wrong tree-mask (request 1, query 11 key 10): request 1's draft node 4 ([1, 0] in eagle_choices) sees draft 3, which",
        "is not its ancestor (draft 3 is [0, 0]): a tree node sees the prefix, its ancestors and itself"]
