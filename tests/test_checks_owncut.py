"""checks/owncut.py: a causal window (L, 0) handed to the kernel over fewer keys than its real queries, the first
queries seeing no key (a step's own keys cut by a window-bounded cache); against the count a bottom-right causal
window over the last W keys leaves blind, Lq - W."""

from __future__ import annotations

import re
from pathlib import Path

from checkbugs import check_bug

OWNCUT = Path(__file__).parent / "data" / "owncut"


def _blind(message: str) -> int:
    return int(re.search(r"\((\d+) such queries", message).group(1))


def test_fla_attention_sliding_window_prefill_takes_the_cut_cache(tmp_path):
    """fla-org/flash-linear-attention#183 (commit c9ea83c; written blind, batch blind-en): fla.layers.attn.Attention
    with window_size=4 and use_cache=True replaced a 12-token prompt's keys by Cache.update's attn_state, already cut
    to the last 4 tokens, under flash-attn's window (3, 0); the fix keeps the prompt's own keys while the cache was
    empty."""
    [hit, *_] = check_bug(tmp_path, "fla_attn_swa_prefill_cache_truncates_keys", "own-keys-cut")
    assert _blind(hit["message"]) == 12 - 4


def test_rolling_buffer_prefill_with_window_left_written_another_way(tmp_path):
    """The same bug in a Mistral-style rolling-buffer cache, a FlashInfer-style `window_left`, SDPA with a bool mask
    and a left-padded batch: the buffer's last 4 keys handed to a 10-token prefill."""
    [hit, *_] = check_bug(tmp_path, "rolling_buffer_prefill_window_left_padded", "own-keys-cut", OWNCUT)
    assert _blind(hit["message"]) == 10 - 4
