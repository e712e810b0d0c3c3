"""checks/steps.py: one call site across its steps, on reproductions of published bugs."""

from __future__ import annotations

import pytest

from checkbugs import check_bug

BUGS = [
    ("padding_mask_first_step_only", "padding-lost"),  # OpenNMT/OpenNMT-py#2532: the pad mask at the first step only
    ("decode_mask_sliced", "padding-lost"),  # thu-nics/C2C#19: the mask sliced to one column at decode
    ("decode_window_dropped", "window-lost"),  # pytorch/executorch#22285: every written slot visible at decode
    ("cached_mask_rows_top_left", "top-left-mask"),  # rasbt/LLMs-from-scratch#1048: mask[:Lq, :Lk] at decode
    ("cached_decode_is_causal_xtransformers", "top-left-mask"),  # lucidrains/x-transformers#187: is_causal with a cache
    ("chunked_prefill_is_causal", "top-left-mask"),  # onnx/onnx#8068, flash-attention#282: chunked prefill top-left
    ("cached_prefill_not_causal", "causal-lost"),  # Mikyx-1/TinyLLM#17: no causal mask once a cache is attached
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)
