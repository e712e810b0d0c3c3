"""checks/routed.py: tokens routed out of each row by a gather in an order their positions do not follow, attended
under a causal mask over the routed order, caught in the published bug's reproduction (tests/data/bugs) and in a
program written another way (tests/data/routed), quiet on the fixes; the flagged cell against a double loop over the
positions the finding reports."""

from __future__ import annotations

import re
from pathlib import Path

from checkbugs import check_bug, first, traced

ROUTED = Path(__file__).parent / "data" / "routed"


def _positions(message: str) -> list[int]:
    return [int(p) for p in re.search(r"order of their positions \(([\d, ]+)\)", message).group(1).split(", ")]


def _reference(found: dict, taken: int) -> tuple:
    """The first cell a causal mask over the routed order keeps whose key sits later in the sequence, in the row."""
    b = found["cell"][0]
    pos = _positions(found["message"])
    q, k = first((1, taken, taken), lambda _, q, k: k <= q and pos[k] > pos[q])[1:]
    return b, q, k


def test_mixture_of_depths_gathering_by_argsort_of_the_topk_indices_is_found(tmp_path):
    """sramshetty/mixture-of-depths#5 (485e14d, written blind): MoDBlock gathers `argsort(topk_indices)`, a
    permutation of 0..k-1, in place of the sorted positions, under its triu mask."""
    found = check_bug(tmp_path, "sramshetty_mixture_of_depths_modblock_argsort_routed_tokens_see_future",
                      "routed-sees-future")
    assert sorted(_positions(found[0]["message"])) == list(range(8))  # (argsort of k indices: 0..k-1, shuffled)
    assert tuple(found[0]["cell"]) == _reference(found[0], 8)
    assert "out of 16" in found[0]["message"]


def test_routed_tokens_gathered_in_router_score_order_are_found(tmp_path):
    """The same bug written another way: torch.topk's indices (best score first) gathered unsorted, SDPA with a bool
    causal-and-padding mask, over a right-padded batch whose padding is never routed."""
    found = check_bug(tmp_path, "mod_topk_by_score_gathered_unsorted", "routed-sees-future", folder=ROUTED)
    pos = _positions(found[0]["message"])
    assert len(set(pos)) == 6 and pos != sorted(pos)
    assert found[0]["cell"][0] != 1 or max(pos) < 9  # (row 1's padding, positions 9..11, is never routed)
    assert tuple(found[0]["cell"]) == _reference(found[0], 6)


def test_routed_tokens_attended_whole_or_causal_right_to_left_are_quiet(tmp_path):
    """Top-k patches gathered best first and attended whole (no order claimed), and routed tokens sorted right to left
    under a causal mask (a backward model): no finding at all."""
    status, found, report = traced(tmp_path, "routed_tokens_unordered_encoder_and_reversed_causal", False, ROUTED)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
