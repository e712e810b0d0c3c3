"""checks/spandocs.py: a packed row's documents (read off its position_ids, as transformers reads them) cut its spans."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from checkbugs import traced
from maskcli.checks.spandocs import by_document


def _packed(lengths: list[int]) -> np.ndarray:
    return np.concatenate([np.arange(n) for n in lengths])[None]


def _reference(positions: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Same block id and same document, by a loop over positions: the document number counts the restarts before."""
    out = np.full(ids.shape, -1)
    for b in range(ids.shape[0]):
        document, names = 0, {}
        for j in range(ids.shape[1]):
            if j and positions[b, j] != positions[b, j - 1] + 1:
                document += 1
            if ids[b, j] >= 0:
                out[b, j] = names.setdefault((document, int(ids[b, j])), len(names))
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """The two numberings put the same tokens together (the numbers themselves may differ)."""
    return bool(((a[:, :, None] == a[:, None, :]) == (b[:, :, None] == b[:, None, :])).all() and ((a < 0) == (b < 0)).all())


def test_each_documents_prefix_is_its_own_span():
    """PaliGemma's block 0 over every prefix token of a packed row: one span per document."""
    positions = _packed([5, 3, 6])
    ids = np.where(np.isin(np.arange(14), [0, 1, 2, 5, 6, 8, 9, 10]), 0, -1)[None]
    cut = by_document(SimpleNamespace(arguments={"position_ids": positions}), ids)
    assert _same(cut, _reference(positions, ids))
    assert len({int(x) for x in cut[cut >= 0]}) == 3


@pytest.mark.parametrize("seed", range(20))
def test_random_packings_against_a_loop(seed):
    rng = np.random.default_rng(seed)
    rows = [_packed(list(rng.integers(1, 6, size=rng.integers(1, 5))))[0] for _ in range(3)]
    length = min(len(r) for r in rows)
    positions = np.stack([r[:length] for r in rows])
    ids = np.where(rng.random(positions.shape) < 0.5, rng.integers(0, 3, size=positions.shape), -1)
    cut = by_document(SimpleNamespace(arguments={"position_ids": positions}), ids)
    assert _same(cut, _reference(positions, ids))


def test_the_documents_transformers_reads():
    """The documents are transformers' own (masking_utils.find_packed_sequence_indices) where its packing is read."""
    torch = pytest.importorskip("torch")
    masking = pytest.importorskip("transformers.masking_utils")
    positions = _packed([4, 2, 5])
    found = masking.find_packed_sequence_indices(torch.as_tensor(positions)).numpy()
    ids = np.zeros_like(positions)
    assert _same(by_document(SimpleNamespace(arguments={"position_ids": positions}), ids), found)


def test_left_alone_with_an_attention_mask_or_unpacked_positions():
    ids = np.zeros((1, 6), dtype=np.int64)
    packed = _packed([3, 3])
    assert by_document(SimpleNamespace(arguments={"position_ids": packed, "attention_mask": np.ones((1, 6))}), ids) is ids
    assert by_document(SimpleNamespace(arguments={"position_ids": np.arange(6)[None]}), ids) is ids
    assert by_document(SimpleNamespace(arguments={}), ids) is ids


def test_transformers_paligemma2_packed_without_padding_is_quiet(tmp_path):
    """quiet-r108a (a correct program, told span-not-bidirectional before): three PaliGemma 2 examples packed into one
    row, position_ids restarting at 1 each, no attention_mask; each prefix both ways within its own document."""
    status, found, report = traced(tmp_path, "quiet_transformers_paligemma2_packed_prefix_lm_sliding_window_eager", False,
                                   Path(__file__).parent / "data" / "quiet_blind")
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report
