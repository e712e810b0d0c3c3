"""checks/steps.py: one call site across its steps, on reproductions of published bugs."""

from __future__ import annotations

import json

import pytest

from checkbugs import check_bug, runner
from maskcli.commands import app

BUGS = [
    ("padding_mask_first_step_only", "padding-lost"),  # OpenNMT/OpenNMT-py#2532: the pad mask at the first step only
    # (thu-nics/C2C#19, decode_mask_sliced: padding-ignored says it, from the model call's attention_mask)
    ("decode_window_dropped", "window-lost"),  # pytorch/executorch#22285: every written slot visible at decode
    ("cached_mask_rows_top_left", "top-left-mask"),  # rasbt/LLMs-from-scratch#1048: mask[:Lq, :Lk] at decode
    # (is_causal with a cache, lucidrains/x-transformers#187 and onnx/onnx#8068: kernels.py's top-left-causal says it,
    # naming is_causal, not top-left-mask a second time: test_checks_kernels.py)
    ("cached_prefill_not_causal", "causal-lost"),  # Mikyx-1/TinyLLM#17: no causal mask once a cache is attached
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


HELPER = '''
import sys
import torch
import torch.nn.functional as F

def attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

def decoder(x, step):
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    return attention(x, x, x, None if step and "--bug" in sys.argv else causal)

torch.manual_seed(0)
x = torch.randn(1, 2, 6, 8)
for step in range(2):
    decoder(x, step)
    attention(x, x, x)  # an encoder's self-attention over the same length: full, as it should be
'''


def test_a_function_shared_by_a_causal_and_a_full_caller_is_two_call_sites(tmp_path):
    """One attention function, called by the decoder (causal) and the encoder (full), is two call sites: the encoder's
    full mask is not the decoder's causal lost. The decoder dropping its causal mask at its second call still is."""
    script = tmp_path / "shared.py"
    script.write_text(HELPER)
    for bug, status in (([], 0), (["--bug"], 1)):
        out = tmp_path / "t.json"
        result = runner.invoke(app, ["trace", "--json", str(out), str(script), *bug])
        found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"]]
        assert result.exit_code == status, result.output
        assert [f["code"] for f in found if f["severity"] == "wrong"] == (["causal-lost"] if bug else []), result.output
