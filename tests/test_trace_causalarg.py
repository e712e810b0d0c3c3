"""trace/causalarg.py: a model call's argument named causal, read as keep cells against torch.tril."""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.causalarg import causal_arg


def test_an_additive_causal_mask_is_read_as_tril_and_an_all_zero_one_as_full():
    bias = torch.zeros(1, 1, 5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    name, kept = causal_arg({"input_ids": torch.ones(2, 5, dtype=torch.long), "causal_mask": bias})["causal_named"]
    assert name == "causal_mask" and (kept == torch.tril(torch.ones(1, 5, 5)).bool().numpy()).all()
    name, kept = causal_arg({"decoder_causal_mask": torch.zeros(4, 4)})["causal_named"]
    assert name == "decoder_causal_mask" and kept.shape == (1, 4, 4) and kept.all()
    finite = torch.zeros(2, 1, 3, 3).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), -1e9)
    assert (causal_arg({"causal_bias": finite})["causal_named"][1] == np.tril(np.ones((3, 3), bool))).all()


def test_names_and_values_not_read():
    assert causal_arg({"attn_mask": torch.zeros(4, 4)}) == {}  # (not named causal)
    assert causal_arg({"non_causal_mask": torch.zeros(4, 4)}) == {}  # (named the other way)
    assert causal_arg({"causal_mask": torch.tril(torch.ones(4, 4))}) == {}  # (0/1 floats: polarity unknown)
    assert causal_arg({"causal_mask": torch.ones(4, 4, dtype=torch.bool).triu(1)}) == {}  # (diagonal False)
    assert causal_arg({"causal_mask": torch.zeros(4, 5)}) == {}  # (not square)
