"""checks/blocksteps.py: blocks drafted in parallel whose block attends its own keys otherwise than the same site's
calls of one block do, caught in the published bug's reproduction (tests/data/bugs) and in a program written another way
(tests/data/blocksteps), quiet on both fixes; the flagged cells against a double loop over positions."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import check_bug, traced
from maskcli.checks.blocksteps import _judged

BLOCKSTEPS = Path(__file__).parent / "data" / "blocksteps"


def test_specforge_dflash_noise_block_seeing_only_later_positions_is_found(tmp_path):
    # sgl-project/SpecForge#427: the [L, 2L] training mask's noise half was same_block & (j >= i), while spec_generate
    # drafts each block of 4 with no mask; the per-block reference calls at the same site are the steps
    found = check_bug(tmp_path, "specforge_dflash_noise_mask_causal_within_block", "blocks-differ-from-steps")
    assert len(found) == 1
    # query 1 (block 0) misses key 0 of its block: the noise half starts at key column 16
    assert tuple(found[0]["cell"]) == (0, 1, 16)
    assert "4 blocks of 4 queries" in found[0]["message"]


def test_block_diffusion_noisy_block_lower_triangular_is_found(tmp_path):
    found = check_bug(tmp_path, "block_diffusion_noisy_block_tril_vs_bidirectional_sampling", "blocks-differ-from-steps",
                      folder=BLOCKSTEPS)
    # query 0 misses key 1 of its block (columns 16..31: the noisy tokens)
    assert tuple(found[0]["cell"]) == (0, 0, 17)


def _reference(lengths: list[int], size: int, q: int, triangle: bool) -> np.ndarray:
    """(B, 1, size, 2 size) keep over [context | own keys]: each real query sees earlier blocks' context and its own
    block's real keys, only those at or before it where `triangle` (a double loop over positions)."""
    cells = np.zeros((len(lengths), 1, size, 2 * size), dtype=bool)
    for b, n in enumerate(lengths):
        for i in range(n):
            for j in range(n):
                cells[b, 0, i, j] = j // q < i // q
                cells[b, 0, i, size + j] = j // q == i // q and (j <= i or not triangle)
    return cells


def test_judged_against_a_double_loop(monkeypatch):
    import maskcli.checks.blocksteps as blocksteps

    monkeypatch.setattr(blocksteps, "keep", lambda c: c.stored["cells"])
    full = np.ones((4, 4), dtype=bool)
    for lengths in ([16, 16], [16, 14], [10, 16]):
        right = _reference(lengths, 16, 4, triangle=False)
        wrong = _reference(lengths, 16, 4, triangle=True)
        assert _judged(SimpleNamespace(shape=right.shape, where="x", stored={"cells": right}), 4, full) is None
        finding = _judged(SimpleNamespace(shape=wrong.shape, where="x", stored={"cells": wrong}), 4, full)
        # every real query misses the real keys after it in its block (padded keys and queries are the padding's)
        expected = 0
        for n in lengths:  # the real keys after a real query in its block, which the triangle hides
            expected += sum(1 for i in range(n) for j in range(n) if j > i and j // 4 == i // 4)
        assert f"({expected} such cells)" in finding.message
        assert finding.cell == (0, 0, 17)


def test_a_causal_prefill_is_no_blocks(monkeypatch):
    import maskcli.checks.blocksteps as blocksteps

    monkeypatch.setattr(blocksteps, "keep", lambda c: c.stored["cells"])
    causal = np.tril(np.ones((16, 16), dtype=bool))[None, None]
    assert _judged(SimpleNamespace(shape=causal.shape, where="x", stored={"cells": causal}), 4, np.ones((4, 4), bool)) is None


def test_packed_segments_of_other_sizes_are_no_blocks(monkeypatch):
    # Pixtral's vision encoder packs images of 12, 4 and 8 patches (block-diagonal, full within each) and runs the
    # 12-patch image alone: the second half of the packed call is two segments, not one block of 12
    import maskcli.checks.blocksteps as blocksteps

    monkeypatch.setattr(blocksteps, "keep", lambda c: c.stored["cells"])
    image = np.repeat(np.arange(3), [12, 4, 8])
    cells = (image[:, None] == image[None, :])[None, None]
    assert _judged(SimpleNamespace(shape=cells.shape, where="x", stored={"cells": cells}), 12, np.ones((12, 12), bool)) is None


def test_requests_packed_into_one_row_over_their_own_caches_are_not_drafted_blocks(tmp_path):
    """transformers' continuous batching (tests/data/quiet_blind, written blind, batch quiet-r68a) written another way
    (tests/data/caches): each step packs its requests into one row, each over its own cached keys, causal within its
    block. A step of two requests of 4 new tokens beside steps of 2 + 2 and of one token each is no drafter's blocks:
    no key before the blocks' own is seen by two of them (blocks drafted from one sequence share its context). Said as
    blocks-differ-from-steps before; quiet now."""
    status, found, report = traced(tmp_path, "packed_requests_one_row_per_step_own_caches", False,
                                   Path(__file__).parent / "data" / "caches")
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "local(4)" in report, report  # (the step of two 4-token requests was read as two blocks of 4)
