"""sources/expression.py: an expression of kinds builds the mask a double loop over absolute positions gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskcli.errors import MaskError
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


def test_terms_bound_before_and_after_join_the_expression_as_one_expression_does():
    # a packed batch's documents before (shard BATCH), a config's chunked layer after (--model): local's chunks
    # restart at each document, as in one typed expression; cells by a double loop
    from maskcli import terms
    from maskcli.kinds import get as get_kind
    from maskcli.kinds.values import from_sizes

    doc = [0, 0, 0, 1, 1, 1, 1, 1]
    documents = terms.bound(get_kind("document"), {"labels": from_sizes([[3, 5]], "sizes")})
    chunked = terms.bound(get_kind("local"), {"chunk_size": 2})
    mask = registry.load("window(3)", MaskOptions(), before=documents, after=chunked)
    start = [0, 0, 0, 3, 3, 3, 3, 3]
    reference = np.array([[doc[q] == doc[k] and k <= q and q - k < 3 and (q - start[q]) // 2 == (k - start[k]) // 2
                           for k in range(8)] for q in range(8)])
    assert np.array_equal(mask.dense()[0, 0], reference)
    typed = registry.load("document(sizes=[3,5]) & window(3) & local(2)", MaskOptions())
    assert (mask.text, mask.expression) == (typed.text, typed.expression)
    alone = registry.load(None, MaskOptions(), before=documents)
    assert np.array_equal(alone.dense()[0, 0], np.array([[doc[q] == doc[k] and k <= q for k in range(8)] for q in range(8)]))
    with pytest.raises(MaskError, match="--window 3 does not apply to 'document"):
        registry.load(None, MaskOptions(params={"--window": 3}), before=documents)
