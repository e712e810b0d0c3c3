"""checks/owncut.py: a causal window (L, 0) handed to the kernel over fewer keys than its real queries, the first
queries seeing no key (a step's own keys cut by a window-bounded cache); against the count a bottom-right causal
window over the last W keys leaves blind, Lq - W."""

from __future__ import annotations

import re
from pathlib import Path

from checkbugs import check_bug, traced

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


def test_a_split_attention_whose_other_part_holds_the_steps_own_keys_is_quiet(tmp_path):
    """sgl-project/sglang#26513's fix (written blind, blind-qo, in tests/data/bugs): FlashInfer's extend over a cached prefix runs a ragged
    pass over the step's own 6 keys (window_left 3), then a paged pass of the same 6 queries over the prefix's last 3
    keys, merged by log-sum-exp: the second holds fewer keys than queries and its queries 3-5 see none of them, but the
    first holds their own keys. The bug (the paged pass planned over slots the step has not written) is said by
    window-dropped."""
    name = "sglang_flashinfer_swa_ragged_prefix_extend_paged_reads_unwritten_slots"
    status, found, report = traced(tmp_path, name, True)
    assert status == 0 and "own-keys-cut" not in {f["code"] for f in found}, report
    status, found, report = traced(tmp_path, name, False)
    assert "window-dropped" in {f["code"] for f in found if f["severity"] == "wrong"}, report  # (test_checks_handed)
