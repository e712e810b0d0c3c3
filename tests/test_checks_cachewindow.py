"""cache-window-overrun (checks/cachewindow.py): a query that sees more keys than the window (and sinks) of the cache
object whose method hands the kernel its keys."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from checkbugs import check_bug
from maskcli.commands import app

CACHES = Path(__file__).parent / "data" / "caches"
runner = CliRunner()


def _window_keys(position: int, window: int, sinks: int) -> int:
    """The keys a sink + sliding-window cache holds for a query at `position` (its own key the newest): a loop over
    the positions before it."""
    return sum(1 for key in range(position + 1) if key < sinks or position - key < window)


def test_a_sliding_window_cache_whose_reset_never_runs(tmp_path):
    """VeloxQuant-MLX#274 (written blind): `SlidingWindowKVCache(window_size=4).attend(q)` hands SDPA the inner
    cache's keys, re-appended on top of the whole history (8 keys at decode 4, where the window holds 4). The fix
    (the inner cache reset) is quiet."""
    found = check_bug(tmp_path, "veloxquant_sliding_window_cache_never_evicts", "cache-window-overrun")
    assert _window_keys(4, 4, 0) == 4  # what the window keeps for the query at position 4
    assert "self.window_size = 4 of SlidingWindowKVCache" in found[0]["message"]
    assert "sees 8 keys in every head (step 4" in found[0]["message"]
    assert found[0]["expected"] == "at most 5 keys"


def test_a_sink_cache_whose_trim_is_never_stored(tmp_path):
    """Written another way: a StreamingLLM-style sink cache (2 sinks, window 4) whose trim rebinds locals only, an
    eager softmax with an additive padding bias over a left-padded batch of two. At most 2 + 4 keys (+1 by the other
    convention); the buggy cache hands the 8th key at decode 5. The fix is quiet."""
    found = check_bug(tmp_path, "sink_cache_trim_never_stored", "cache-window-overrun", folder=CACHES)
    assert max(_window_keys(p, 4, 2) for p in range(11)) == 6
    assert "and 2 sink tokens" in found[0]["message"] and "sees 8 keys" in found[0]["message"]
    assert found[0]["expected"] == "at most 7 keys"


LOCAL = '''
import torch, torch.nn as nn, torch.nn.functional as F

class LocalAttention(nn.Module):
    """lucidrains-style local attention: blocks of window_size, each query sees its block and the one before."""
    def __init__(self, window_size):
        super().__init__()
        self.window_size = window_size

    def forward(self, q, k, v):
        n, w = q.shape[-2], self.window_size
        i = torch.arange(n)
        keep = (i[None, :] <= i[:, None]) & (i[None, :] // w >= i[:, None] // w - 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

class Cache:
    """A plain object holding a window the kernel's keys do not come from."""
    def __init__(self):
        self.window_size = 2

    def run(self, layer, x):
        return layer(x, x, x)

x = torch.randn(1, 2, 8, 4)
Cache().run(LocalAttention(2), x)
'''


def test_a_module_held_block_window_and_an_object_around_the_module_are_quiet(tmp_path):
    """A module's own int window_size (a local-attention block: each query sees up to 4 keys, 2 blocks of 2) is no
    cache's window, and an object holding window_size = 2 whose method runs the module from outside it (an engine, a
    generator: its window may be some layers') says nothing of this call's keys: both quiet."""
    # the reference: the local attention's keys per query, a double loop over positions
    seen = [sum(1 for k in range(8) if k <= q and k // 2 >= q // 2 - 1) for q in range(8)]
    assert max(seen) == 4 > 2 + 1
    out = tmp_path / "local.json"
    for text in (LOCAL, LOCAL.replace("Cache().run(LocalAttention(2), x)", "LocalAttention(2)(x, x, x)")):
        program = tmp_path / "local.py"
        program.write_text(text)
        result = runner.invoke(app, ["trace", "--json", str(out), str(program)])
        assert result.exit_code == 0, result.output
        found = [f for g in json.loads(out.read_text())["groups"] for f in g["findings"]]
        assert [f for f in found if f["severity"] == "wrong"] == [], result.output


def test_a_kv_press_observation_window_is_no_cache_bound_nor_the_attentions_window(tmp_path):
    """NVIDIA/kvpress#227 (42175e7; written blind, blind-nm): SnapKVPress holds `window_size = 8` beside its
    `compression_ratio = 0.75`, the last 8 queries that score which keys to keep. Before round 82 both runs were told
    cache-window-overrun (the window read as the cache's bound), window-missing (as the attention's) and
    causal-flag-ignored (its scoring softmax of 8 queries placed at the keys' start by the cache's length as the call
    ended, after the press had evicted). A share of the keys kept states an observation window
    (checks/fieldnames.py's observation_window), and a dynamic cache's length places no queries. The bug itself (a
    window key evicted on a tie) is not found: no finding on either run."""
    from checkbugs import traced
    from maskcli.checks.fieldnames import observation_window

    assert observation_window({"compression_ratio": 0.75, "window_size": 8}, 8)
    assert observation_window({"max_capacity_prompt": 64, "window_size": 8}, 8)
    assert not observation_window({"window_size": 8, "dropout_ratio": 0.1}, 8)
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "kvpress_snapkv_window_padded_with_tied_max_score", fixed,
                                       Path(__file__).parent / "data" / "blind")
        codes = {f["code"] for f in found}
        assert status == 0 and not codes & {"cache-window-overrun", "window-missing", "causal-flag-ignored"}, report
