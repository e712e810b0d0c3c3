"""keys-evicted-before-mask (checks/evicted.py): a self-attention's first step with fewer keys than queries, whose
mask leaves real queries with no key."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from checkbugs import caught, check_bug, first
from maskcli.commands import app


def test_a_streaming_cache_that_evicts_inside_the_call_under_a_bottom_right_causal_mask(tmp_path):
    """VeloxQuant-MLX#370 (written blind): 12 queries, 8 kept keys, torch's causal_lower_right; written another way: a
    BERT-named `attention.self` with a softmax of its own and a `tril(ones(L, S), S - L)` mask over 6 kept keys of a
    batch of 2. Both fixes (every key returned, eviction after the call) are quiet."""
    found = check_bug(tmp_path, "veloxquant_streaming_llm_eviction_causal_string_mask", "keys-evicted-before-mask")
    # the reference: torch's own lower-right triangle of 12 queries over 8 keys, its first keyless row
    keep = torch.tril(torch.ones(12, 8, dtype=torch.bool), diagonal=8 - 12)
    assert found[0]["cell"][1] == first((1, 12, 1), lambda b, q, k: not keep[q].any())[1] == 0
    assert "queries 0-3 see no key" in found[0]["message"]
    hit = caught(tmp_path, "evicting_cache_lower_right_softmax", ("keys-evicted-before-mask",))
    assert "queries 0-3" in hit["message"] and "10 queries 6 keys" in hit["message"]


LINFORMER = '''
import torch, torch.nn as nn, torch.nn.functional as F

class SelfAttention(nn.Module):
    """Linformer: keys projected to 4 along the sequence, every query sees every one of them."""
    def __init__(self):
        super().__init__()
        self.e = nn.Linear(10, 4)
    def forward(self, x):
        q = x[:, None]
        k = self.e(x.transpose(1, 2)).transpose(1, 2)[:, None]
        return F.scaled_dot_product_attention(q, k, k)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = SelfAttention()
    def forward(self, x):
        return self.self_attn(x)

Net()(torch.randn(2, 10, 8))
'''


def test_a_self_attention_over_fewer_keys_whose_queries_each_see_some_is_quiet(tmp_path):
    """A Linformer's projected keys (fewer than its queries, no mask): no query is left without a key."""
    program = tmp_path / "linformer.py"
    program.write_text(LINFORMER)
    out = tmp_path / "linformer.json"
    result = CliRunner().invoke(app, ["trace", "--json", str(out), str(program)])
    found = [f["code"] for group in json.loads(out.read_text())["groups"] for f in group["findings"]]
    assert "keys-evicted-before-mask" not in found and result.exit_code == 0, result.output
