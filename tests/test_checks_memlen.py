"""checks/memlen.py (and trace/stated.py's `mem_len`): a recurrent-memory model's queries against the memory length
it states."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

MEMLEN = Path(__file__).parent / "data" / "memlen"


def test_feedback_transformer_memory_truncated_on_batch_axis(tmp_path):
    """feedback-transformer-pytorch 683bba1: `memory_keys[-mem_len:]` slices the batch, the memory grows past mem_len."""
    check_bug(tmp_path, "feedback_transformer_memory_truncated_on_batch_axis", "memory-over-length")


def test_xl_memory_size_checked_on_batch_axis(tmp_path):
    """Written another way: mem_len on the layer itself, SDPA with a bool mask, the size test on the batch axis; the
    first cell is a double loop's over segments of 3 behind a memory of every earlier one (a query that sees a key
    older than the 4 memory positions). Its fix keeps the whole buffer and hides the older keys: quiet."""
    status, found, report = traced(tmp_path, "xl_memory_size_checked_on_batch_axis", False, MEMLEN)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "memory-over-length"]
    assert hits and all(f["severity"] == "wrong" for f in hits), report
    mem_len, segment = 4, 3
    memory = next(m for m in range(0, 12, segment) if m > mem_len)  # the first call whose memory outgrows it
    assert tuple(hits[0]["cell"]) == first(
        (2, segment, memory + segment), lambda b, q, k: k <= memory + q and k < memory - mem_len)
    status, found, report = traced(tmp_path, "xl_memory_size_checked_on_batch_axis", True, MEMLEN)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
