"""checks/permuted.py (and trace/permuted.py, which keeps each gather that reorders a model call's tokens within their
rows): a padding mask that keeps the tokens' order from before they were sorted."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug
from maskcli.checks.permuted import _order
from maskcli.trace.capture import Trace

PERMUTED = Path(__file__).parent / "data" / "permuted"
CELL = re.compile(r"batch row (\d+): key (\d+) is (seen|hidden), .* key \2 is token (\d+), which .* calls (padding|a real "
                  r"token)")


def _said(hit: dict) -> tuple[int, int, bool, int, bool]:
    """(row, key, seen, token, the token real) as the finding words them."""
    b, k, seen, token, said = CELL.search(" ".join(hit["message"].split())).groups()
    return int(b), int(k), seen == "seen", int(token), said != "padding"


def test_hepattn_encoder_sorted_hits_kv_mask_not_permuted(tmp_path):
    """samvanstroud/hepattn commit c85cf35 ("fix encoder bug where kv mask is not permuted"; written blind, batch
    blind-ee): the Encoder gathers its hits into `x_sort_value` order and hands the `kv_mask` (True = a real hit) on
    as it came; the fix gathers the mask by the same `x_sort_idx`."""
    [hit] = check_bug(tmp_path, "hepattn_encoder_sorted_hits_kv_mask_not_permuted", "padding-not-permuted")
    # the program's own batch: 16 and 9 hits right padded to 16; only row 1 has pads. The unsorted mask shows keys
    # 0..8 whatever tokens sit there; the token named is real exactly when it is one of the first 9 as they came
    b, k, seen, token, real = _said(hit)
    assert b == 1 and seen == (k < 9) and real == (token < 9) and seen != real
    assert "kv_mask" in hit["message"]


def test_event_sequence_sorted_by_time_pad_mask_unsorted(tmp_path):
    """Written another way: events of a left-padded history (`padding_mask`, True = padding; counts 10, 6, 8 of 10)
    sorted by time with torch.sort and Tensor.gather before nn.MultiheadAttention, the key padding mask handed on
    unsorted."""
    [hit] = check_bug(tmp_path, "event_sequence_sorted_by_time_pad_mask_unsorted", "padding-not-permuted", PERMUTED)
    b, k, seen, token, real = _said(hit)
    pads = 10 - (10, 6, 8)[b]
    assert b in (1, 2) and seen == (k >= pads) and real == (token >= pads) and seen != real
    assert "padding_mask" in hit["message"]


def _kept(make) -> tuple:
    """What trace/permuted.py kept of the gathers `make(x)` ran inside one outermost module call."""
    class Model(torch.nn.Module):
        def forward(self, x):
            x = make(x)
            return torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])

    with Trace() as t:
        Model()(torch.randn(3, 6, 4))
    return t.tops[0].permuted


def test_the_permutation_kept_against_argsort():
    """torch.gather and Tensor.gather along the tokens by a row-wise argsort keep that argsort; a gather of repeated
    positions (a top-k with ties kept twice), one along the features, and one in order keep nothing."""
    keys = torch.rand(3, 6)
    order = torch.argsort(keys, dim=-1)
    [kept] = _kept(lambda x: torch.gather(x, -2, order.unsqueeze(-1).expand_as(x)))
    assert kept["rows"].tolist() == [sorted(range(6), key=lambda i: float(keys[b, i])) for b in range(3)]
    [kept] = _kept(lambda x: x.gather(1, order[..., None].expand(-1, -1, 4)))
    assert kept["rows"].tolist() == order.tolist()
    repeated = torch.tensor([[0, 0, 1, 2, 3, 4]] * 3)
    assert _kept(lambda x: x.gather(1, repeated[..., None].expand(-1, -1, 4))) == ()
    assert _kept(lambda x: x.gather(2, torch.argsort(torch.rand(3, 6, 4), dim=-1))) == ()
    assert _kept(lambda x: x.gather(1, torch.arange(6).expand(3, 6)[..., None].expand(-1, -1, 4))) == ()


def test_reorderings_compose_as_indexing_does():
    """Two gathers in a row put token p1[p2[k]] at k, as indexing the tokens twice does; a third one after the call
    is not applied to it."""
    rng = np.random.default_rng(0)
    p1, p2, p3 = (np.stack([rng.permutation(5) for _ in range(2)]) for _ in range(3))
    tokens = np.arange(10).reshape(2, 5) * 10
    twice = np.stack([tokens[b][p1[b]][p2[b]] for b in range(2)])
    order = _order(({"after": 0, "rows": p1}, {"after": 0, "rows": p2}, {"after": 2, "rows": p3}), 1)
    assert (np.take_along_axis(tokens, order, axis=1) == twice).all()
