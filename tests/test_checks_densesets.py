"""checks/densesets.py (and trace/held.py's batch vector, PyG's `batch` or an aggregation's `index`): attention over
a dense batch of sets (to_dense_batch, pad_sequence) against the size each set has."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

SETS = Path(__file__).parent / "data" / "sets"


def first_padded(batch_rows: int, sizes: list[int], q_len: int, k_len: int) -> tuple[int, int, int]:
    """The first (b, q, k) where a real query sees a padded key under every reading of the batch rows as the sets (heads
    folded tiled, b % G, or interleaved, b // H), by a plain loop over the cells (the tests' reference)."""
    sets = len(sizes)
    readings = [lambda b: b] if batch_rows == sets else [lambda b: b % sets, lambda b: b // (batch_rows // sets)]
    for b in range(batch_rows):
        for q in range(q_len):
            for k in range(k_len):
                if all(k >= sizes[read(b)] and (q_len != k_len or q < sizes[read(b)]) for read in readings):
                    return b, q, k
    raise AssertionError("no padded cell")


def test_pyg_set_transformer_aggregation_drops_dense_batch_mask(tmp_path):
    """pyg-team/pytorch_geometric#6338 (0758c92; written blind, batch blind-el): `x, _ = self.to_dense_batch(...)`, so
    the SAB encoder and the PMA seeds (heads folded onto the batch axis by `torch.cat(Q.split(d, 2), 0)`) attend the
    zero rows of the smaller sets. The fix hands `key_padding_mask=~mask` to nn.MultiheadAttention."""
    found = check_bug(tmp_path, "pyg_set_transformer_aggregation_drops_dense_batch_mask", "set-padding-attended")
    sizes = [7, 3, 5]
    b, q, k = first_padded(12, sizes, 7, 7)
    assert tuple(found[0]["cell"]) == (b, 0, q, k)
    assert "index in forward()" in found[0]["message"] and "sets of 7, 3, 5" in found[0]["message"]


def test_point_sets_padded_with_pad_sequence_attended_by_sdpa(tmp_path):
    """Written another way: a `batch` vector from repeat_interleave, the sets padded by pad_sequence, SDPA with heads on
    their own axis and no mask; the fix hands SDPA the (G, 1, 1, N) mask of real points."""
    found = check_bug(tmp_path, "point_sets_pad_sequence_sdpa_without_key_mask", "set-padding-attended", SETS)
    b, q, k = first_padded(4, [4, 6, 2, 5], 6, 6)
    assert tuple(found[0]["cell"]) == (b, 0, q, k)


def test_quiet_on_sets_of_one_size(tmp_path):
    """The same encoder over sets all of one size: no padding, nothing said."""
    program = tmp_path / "one_size.py"
    source = (SETS / "point_sets_pad_sequence_sdpa_without_key_mask.py").read_text()
    program.write_text(source.replace("sizes = [4, 6, 2, 5]", "sizes = [5, 5, 5]"))
    status, found, report = traced(tmp_path, "one_size", False, tmp_path)
    assert not [f for f in found if f["code"] == "set-padding-attended"], report
