"""checks/stepwindows.py: one call site whose prompt pass and decode steps lay sliding windows of different widths."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced

WINDOWS = Path(__file__).parent / "data" / "windows"


def _widest(mask: torch.Tensor) -> int:
    """The most keys a query row of a (Lq, Lk) keep mask sees, by a loop over its cells."""
    return max(sum(1 for k in range(mask.shape[1]) if mask[q, k]) for q in range(mask.shape[0]))


def test_eole_prefill_sliding_window_one_key_too_many(tmp_path):
    """eole-nlp/eole#340: the prefill mask `tril & triu_(-sliding_window)` gives each prompt token sliding_window + 1
    keys while the cached decode keeps `position >= step - sliding_window + 1`, sliding_window keys (both over a
    static buffer of 16 slots). The fix's token-by-token decode over the buffer, filled slot by slot from position 0,
    is no top-left mask (its queries are the written slots, trace/zerokv.py's `unwritten`)."""
    window = 4
    prefill = torch.ones(10, 16, dtype=torch.bool).tril().triu(-window)
    [hit, *_] = check_bug(tmp_path, "eole_prefill_sliding_window_one_key_too_many", "window-differs-at-decode")
    assert f"is window({_widest(prefill)})" in hit["message"] and f"sees the {window} keys up to its own" in hit["message"]


def test_a_left_padded_prompt_mask_that_counts_the_query_beside_its_window(tmp_path):
    """Written another way: a dynamic cache grown by torch.cat over a left-padded batch of two prompts; the prompt mask
    keeps `q - k <= window` (window + 1 keys), each decode step `q - k < window`. Found on both layers; the fix quiet."""
    name = "left_padded_prefill_window_counts_the_query_twice"
    status, found, report = traced(tmp_path, name, False, WINDOWS)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "window-differs-at-decode" and f["severity"] == "wrong"]
    q = torch.arange(7)[:, None]
    k = torch.arange(7)[None, :]
    assert len(hits) == 2 and f"is window({_widest((k <= q) & (q - k <= 3))})" in hits[0]["message"], report
    status, found, report = traced(tmp_path, name, True, WINDOWS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
