"""checks/chunkrows.py: a chunked prefill over a fixed-size (ring) cache whose later rows see the whole ring and the
chunk's keys, on a reproduction of a published bug and on the same bug written otherwise."""

from __future__ import annotations

from checkbugs import caught, check_bug


def _counts(ring: int, chunk: int, start: int) -> list[int]:
    """Keys each row of the chunk at `start` sees when every cached key is opened to every row: a loop over the
    positions the ring holds (the last `ring` before `start`) and the chunk's own up to the row's."""
    held = [p for p in range(start) if p >= start - ring]
    return [sum(1 for p in held if p <= start + k) + sum(1 for p in range(start, start + chunk) if p <= start + k)
            for k in range(chunk)]


def test_executorch_static_attention_chunked_prefill_local_cache_rows_overattend(tmp_path):
    """pytorch/executorch#21857: a local layer's chunk rows see cache_len + k + 1 keys (written blind, batch blind-y;
    caught by this rule, written for it). Fix quiet."""
    found = check_bug(tmp_path, "executorch_static_attention_chunked_prefill_local_cache_rows_overattend",
                      "chunk-rows-overattend")
    first, *_, last = _counts(3, 2, 4)  # cache_len 3, chunks of 2: the ring is full from the third chunk on
    assert found[0]["message"].startswith(f"at step 3 the first query sees {first} keys, as at step 2, but the last "
                                          f"query of step 2 saw {last}")


def test_a_ring_beside_a_growing_global_cache_whose_chunk_rows_see_the_whole_ring(tmp_path):
    """The same bug written otherwise: a ring of 4 beside a global layer whose cache grows, chunks of 3, SDPA with a
    bool mask, a batch of two."""
    hit = caught(tmp_path, "ring_cache_chunk_rows_see_whole_ring", ("chunk-rows-overattend",))
    first, *_, last = _counts(4, 3, 6)
    assert (first, last) == (5, 7)
    assert hit["message"].startswith(f"at step 3 the first query sees {first} keys, as at step 2, but the last query "
                                     f"of step 2 saw {last}")
    assert hit["source"].startswith("0, a layer of the same step, holds")


def test_llms_from_scratch_window_cache_cut_before_the_chunk_reads_it(tmp_path):
    """rasbt/LLMs-from-scratch#1008 (written blind, batch blind-nw; caught before any rule changed for it): the
    sliding-window cache is trimmed to its 4 keys before a chunk of 3 attends, so each chunk's first rows see 2 and 3
    keys where their window holds 4 (the later rows see 4, right). The cells say only that one chunk's rows see
    windows of different widths, and the finding names both readings. Fix (attend over W + 3 - 1 keys, store W) quiet."""
    found = check_bug(tmp_path, "llms_from_scratch_swa_cache_trim_chunked_prefill_loses_window", "chunk-rows-overattend")
    assert found[0]["message"].startswith("at step 2 the first query sees 2 keys, as at step 1, but the last query of "
                                          "step 1 saw 4: rows of one chunk see windows of different widths over a "
                                          "cache of fixed size, a window of 2 keys the later rows see past, or one of "
                                          "4 the cache cut before the chunk's first rows read it")
