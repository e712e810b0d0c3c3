"""checks/queriesonbatch.py: a (Lq, Lk) mask whose query axis was laid on the batch axis, caught in the published bug's
reproduction (tests/data/bugs) and in a program written another way (tests/data/queriesonbatch), quiet on the fixes, on
a (B, Lk) key padding repeated over the queries and on a plane whose rows are all equal; the flagged cell against a
double loop over what the misplaced broadcast does."""

from __future__ import annotations

from pathlib import Path

import torch

import maskcli
from checkbugs import check_bug, first
from maskcli.checks.registry import severity

QUERIESONBATCH = Path(__file__).parent / "data" / "queriesonbatch"


def _on_batch_cell(plane: list[list[int]]):
    """The first (b, q, k) where query q of batch row b sees key k through plane row b while plane row q hides it."""
    n, length = len(plane), len(plane[0])
    return first((n, n, length), lambda b, q, k: plane[b][k] and not plane[q][k])


def test_keras_fused_path_two_d_mask_expanded_on_axis_one_is_found(tmp_path):
    # keras-team/keras#20488 (blind-db): MultiHeadAttention's fused path grows a (T, S) mask with expand_dims(axis=1)
    # and tiles it over the heads; B == T == 5, the causal triangle handed 2-D and, at the same layer, 3-D
    found = check_bug(tmp_path, "keras_mha_fused_path_2d_attention_mask_expanded_on_batch_axis", "queries-on-batch")
    causal = [[int(k <= q) for k in range(5)] for q in range(5)]
    assert tuple(found[0]["cell"]) == _on_batch_cell(causal)
    assert "query axis laid on the batch axis" in found[0]["message"]


def test_a_band_cross_mask_unsqueezed_into_eager_scores_is_found(tmp_path):
    # written otherwise: a hand-written cross-attention, eager masked_fill with -inf, a monotonic band (T, S) = (4, 8)
    # mask that is no padding table, B == T == 4
    found = check_bug(tmp_path, "monotonic_band_cross_mask_unsqueezed_on_batch_axis", "queries-on-batch",
                      folder=QUERIESONBATCH)
    band = [[int(abs(s - 2 * t) <= 1) for s in range(8)] for t in range(4)]
    assert tuple(found[0]["cell"]) == _on_batch_cell(band)


def _codes(run) -> list:
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        run()
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings]


def test_a_key_padding_over_the_queries_and_equal_rows_are_quiet():
    x = torch.randn(3, 2, 3, 8)

    def padding(attention_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]])):
        # a (B, Lk) key padding of right-padded rows, repeated over the queries: its rows are runs at an edge and no
        # 3-D spelling says it is (queries, keys)
        grown = attention_mask[:, None, None, :]
        (x @ x.transpose(-1, -2)).masked_fill(grown == 0, float("-inf")).softmax(-1)

    def equal(attention_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1]])):
        # every query row alike: laying it on the batch axis changes nothing
        grown = attention_mask.unsqueeze(1).unsqueeze(1)
        (x @ x.transpose(-1, -2)).masked_fill(grown == 0, -1e9).softmax(-1)

    assert [c for c in _codes(padding) + _codes(equal) if c[0] == "queries-on-batch"] == []
