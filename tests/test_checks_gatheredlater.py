"""checks/gatheredlater.py: a branch whose keys are gathered per position keeps more slots for a query at p than the
p + 1 positions 0 .. p, beside a causal branch of the same run (suspicious: a key gathered twice is not seen)."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

from checkbugs import BUGS, traced

GATHERED = Path(__file__).parent / "data" / "gatheredlater"
WINDOWS = Path(__file__).parent / "data" / "windows"
CODE = "gathered-keys-outnumber-past"


def _first_later(layer, x: torch.Tensor, real: torch.Tensor) -> tuple | None:
    """The first (b, p, t), by a double loop over absolute positions, where the layer's output at a real query p
    moves when the input at a later position t > p does: the first query that sees a later key (the reference)."""
    with torch.no_grad():
        base = layer(x)
        for b in range(x.shape[0]):
            for p in range(x.shape[1]):
                if not real[b, p]:
                    continue
                for t in range(p + 1, x.shape[1]):
                    moved = x.clone()
                    moved[b, t] += 1.0
                    if (layer(moved)[b, p] - base[b, p]).abs().max() > 1e-6:
                        return b, p, t
    return None


def _found(tmp_path, name, folder, fixed):
    status, found, report = traced(tmp_path, name, fixed, folder)
    return status, [f for f in found if f["code"] == CODE], [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_nsa_interpolated_importance_scores_select_future_blocks(tmp_path):
    """lucidrains/native-sparse-attention-pytorch 36837b2 (written blind, batch blind-fv): bilinear interpolation smears
    importance into the still-future compressed block, so the fine branch keeps future selection blocks (its keys
    gathered per position, no causal mask on selected blocks) beside the causal sliding branch. The cell's query
    against the first position of layer 0 whose attention output moves with a later token (seed 0, before the step);
    the fix keeps at most p + 1 slots everywhere."""
    name = "nsa_interpolated_importance_score_selects_future_blocks"
    _, hits, _, report = _found(tmp_path, name, BUGS, False)
    assert len(hits) == 1 and hits[0]["severity"] == "suspicious", report
    program = runpy.run_path(str(BUGS / f"{name}.py"), run_name="x")
    torch.manual_seed(0)
    model = program["Transformer"](num_tokens=64, dim=32, depth=2, dim_head=8, heads=4, kv_heads=2,
                                   sparse_attn_kwargs=dict(sliding_window_size=4, compress_block_size=8,
                                                           selection_block_size=2, num_selected_blocks=6,
                                                           interpolated_importance_score=True,
                                                           query_heads_share_selected_kv=True))
    torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randint(0, 64, (2, 21))
    with torch.no_grad():
        tokens = model.token_emb(data[:, :-1])
    ref = _first_later(model.layers[0][0], tokens, torch.ones(2, 20, dtype=torch.bool))
    assert ref is not None and tuple(hits[0]["cell"][:2]) == ref[:2], (hits[0], ref)
    assert f"the query at position {ref[1]} of batch row {ref[0]} keeps 13 slots" in " ".join(hits[0]["message"].split())
    status, hits, flagged, report = _found(tmp_path, name, BUGS, True)
    assert hits == [] and flagged == [] and status == 0, report


def test_selected_blocks_with_no_causal_mask_left_padded(tmp_path):
    """Written another way: a layer holding sliding_window_size = 3 ranks every block by its mean key and keeps the top
    2 with no eligibility mask, its keys gathered per position beside an SDPA sliding child over a left-padded batch;
    the fix keeps only the blocks that ended before the query. The cell against the first real position whose output
    moves with a later input."""
    name = "selected_blocks_topk_no_causal_mask_left_padded"
    _, hits, _, report = _found(tmp_path, name, GATHERED, False)
    assert len(hits) == 1 and hits[0]["severity"] == "suspicious", report
    program = runpy.run_path(str(GATHERED / f"{name}.py"), run_name="x")
    torch.manual_seed(0)
    layer = program["SparseBlockLayer"]().eval()
    x = torch.randn(2, 12, 16)
    real = torch.arange(12)[None, :] >= (12 - torch.tensor([12, 9]))[:, None]
    ref = _first_later(lambda y: layer(y, real), x, real)
    assert ref is not None and tuple(hits[0]["cell"][:2]) == ref[:2], (hits[0], ref)
    status, hits, flagged, report = _found(tmp_path, name, GATHERED, True)
    assert hits == [] and flagged == [] and status == 0, report


def test_quiet_on_causal_selected_blocks_beside_a_sliding_child(tmp_path):
    """Correct: the same layer with only the ended blocks eligible (tests/data/windows): no finding."""
    status, hits, flagged, report = _found(tmp_path, "selected_blocks_gathered_beside_sliding_submodule", WINDOWS, False)
    assert hits == [] and flagged == [] and status == 0, report
