"""sources/expression.py: an expression of kinds builds the mask a double loop over absolute positions gives."""

from __future__ import annotations

import numpy as np
import torch

from maskcli.mask import MaskOptions
from maskcli.sources import expression, registry


def test_the_registry_knows_the_expression_source():
    assert registry.sources()["expression"].load is expression.load


def test_causal_and_window_match_a_double_loop():
    mask = registry.load("causal & window(2)", MaskOptions(length=6))
    reference = np.array([[k <= q and q - k < 2 for k in range(6)] for q in range(6)])
    assert np.array_equal(mask.dense()[0, 0], reference)
    assert np.array_equal(expression.load("causal", MaskOptions(length=5)).dense()[0, 0], torch.ones(5, 5).tril().bool().numpy())


def test_rows_and_keys_view_a_region_of_the_mask():
    mask = registry.load("causal", MaskOptions(length=8, rows="4:6", keys="2:6"))
    assert np.array_equal(mask.dense()[0, 0], np.array([[k <= q for k in range(2, 6)] for q in range(4, 6)]))
