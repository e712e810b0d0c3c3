"""checks/causal_lm.py: a model named ...ForCausalLM whose prompt pass attends both ways, then decodes over its cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkbugs import caught, check_bug, first

BUGS = [
    # huggingface/transformers#48748: Doge's dynamic mask under SDPA's is_causal skip (transformers' own classes)
    ("doge_sdpa_causal_skip_dynamic_mask", "causal-lm-both-ways"),
    # unslothai/unsloth#2868: the SDPA fallback always called with is_causal=False, no mask
    ("unsloth_sdpa_fallback_is_causal_false", "causal-lm-both-ways"),
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_a_left_padded_prompt_handed_the_padding_mask_alone(tmp_path):
    """Written otherwise: SDPA given the padding mask as attn_mask (so no is_causal) on a left-padded batch. Its first
    cell against torch.tril: the first real query that sees a real key tril hides."""
    hit = caught(tmp_path, "causal_lm_padding_mask_only", ("causal-lm-both-ways",))
    real = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=bool)
    tril = torch.ones(5, 5, dtype=torch.bool).tril().numpy()
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: real[b, q] and real[b, k] and not tril[q, k])
