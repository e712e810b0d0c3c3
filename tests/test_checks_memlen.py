"""checks/memlen.py (and trace/stated.py's `mem_len`): a recurrent-memory model's queries against the memory length
it states."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

MEMLEN = Path(__file__).parent / "data" / "memlen"
BUGS = Path(__file__).parent / "data" / "bugs"


def test_feedback_transformer_memory_truncated_on_batch_axis(tmp_path):
    """feedback-transformer-pytorch 683bba1: `memory_keys[-mem_len:]` slices the batch, the memory grows past mem_len.

    Its fix keeps upstream's RelativePositionBias, which puts the queries at arange(i) while the causal mask puts them
    after the memory (triu_(j - i + 1)): at a segment after the first, a query's bias toward a memory key is that of a
    key after it. position-bias-misplaced says so on both versions, and it is the only wrong finding on the fix."""
    name = "feedback_transformer_memory_truncated_on_batch_axis"
    status, found, report = traced(tmp_path, name, False, BUGS)
    assert status == 1 and any(f["code"] == "memory-over-length" and f["severity"] == "wrong" for f in found), report
    status, found, report = traced(tmp_path, name, True, BUGS)
    (bias,) = [f for f in found if f["severity"] == "wrong"]
    assert bias["code"] == "position-bias-misplaced" and status == 1, report
    # the first cell, segment 2 (2 memory positions, 2 queries: 4 keys): query 2 toward key 1, one key before it as the
    # mask places the query, one key after it as the bias does (its row 0)
    q_len, k_len = 2, 4
    query, key = tuple(bias["cell"])[1:]
    assert (query, key) == (2, 1)
    assert key - query == -1 and key - (query - (k_len - q_len)) == 1


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
