"""checks/evictbudget.py (and trace/evictbudget.py): a heavy-hitter KV cache's decode queries against the
`heavy_budget` + `recent_budget` (`hh_size` + `recent_size`) its module states."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from checkbugs import check_bug, runner
from maskcli.commands import app

EVICT = Path(__file__).parent / "data" / "evictbudget"


def test_h2o_heavy_hitter_mask_aliased_by_score_mask(tmp_path):
    """FMInference/H2O PR #34 (commits df486e7, d5962aa; written blind, batch blind-dr): the next step's mask a view of
    the one `score_mask[:, -recent_budget:] = 1` writes into, never zeroed with recent_budget 0. With heavy 4 + recent
    4 over a 16-token prompt the first decode query keeps one key more than 8; heavy-only (8 + 0) keeps every key."""
    hits = check_bug(tmp_path, "h2o_llama_heavy_hitter_mask_aliased_by_score_mask", "evicted-keys-attended")
    counts = [tuple(map(int, re.search(r"sees (\d+) of (\d+) keys", f["message"]).groups())) for f in hits]
    assert counts[0] == (4 + 4 + 1, 16 + 1)  # the prompt's 16 keys and the new token's, one past the budget
    assert (16 + 1, 16 + 1) in counts  # the heavy-only run: the mask never cleared, every key kept
    assert all(f["expected"] in ("at most 8 keys per query (4 heavy + 4 recent)",
                                 "at most 8 keys per query (8 heavy + 0 recent)") for f in hits)


def test_h2o_kv_cluster_keep_buffer_never_cleared(tmp_path):
    """Written another way: hh_size / recent_size of a KVCache-Factory-style module, a left-padded batch of two, a
    bool mask filled before the softmax, the keep mask a slice of one buffer reused by every step (never cleared):
    each step keeps one key more than the last, past 3 + 3. The fix builds the mask fresh: quiet."""
    hits = check_bug(tmp_path, "h2o_kv_cluster_keep_buffer_never_cleared", "evicted-keys-attended", EVICT)
    counts = [tuple(map(int, re.search(r"sees (\d+) of (\d+) keys", f["message"]).groups())) for f in hits]
    assert all(seen > 3 + 3 and seen < keys for seen, keys in counts)
    assert [keys for _, keys in counts] == sorted(keys for _, keys in counts)


PROGRAM = '''
import sys
import torch
import torch.nn.functional as F
from torch import nn

class Evicting(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.heavy_budget = self.recent_budget = None

    def forward(self, x, keep=None):
        q = k = v = self.proj(x).view(1, 1, -1, 8)
        if keep is None:  # the prefill: causal, the budgets set from it (as H2O's ratios do)
            self.heavy_budget, self.recent_budget = 2, 2
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q[:, :, -1:], k, v, attn_mask=keep)

attn = Evicting()
x = torch.randn(1, 8, 8)
attn(x)
kept = [int(i) for i in sys.argv[1].split(",")]
attn(x, torch.tensor([[[[k in kept for k in range(8)]]]]))
'''


@pytest.mark.parametrize("kept", [(0, 1, 6, 7), (0, 1, 5, 6, 7), (1, 2, 3, 4, 5, 6, 7), (6, 7)])
def test_a_decode_query_is_flagged_only_past_heavy_plus_recent(tmp_path, kept):
    """Against a count of the kept keys: more than heavy_budget + recent_budget (2 + 2, set by the first forward)
    is wrong, at most that is quiet."""
    program, out = tmp_path / "evicting.py", tmp_path / "out.json"
    program.write_text(PROGRAM)
    result = runner.invoke(app, ["trace", "--json", str(out), str(program), ",".join(map(str, kept))])
    found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"]
             if f["code"] == "evicted-keys-attended"]
    if len(kept) > 2 + 2:
        assert result.exit_code == 1 and len(found) == 1, result.output
        assert f"sees {len(kept)} of 8 keys" in found[0]["message"] and found[0]["cell"] == [0, 0, kept[0]]
    else:
        assert result.exit_code == 0 and found == [], result.output
