"""checks/cachedrop.py: a query behind a sliding cache that sees fewer keys than the same site's one pass over the same
token ids shows its position; on a published bug written blind (ollama's wrapped ring buffer) and a second program
written another way (a trimmed list cache, einsum scores, a batch of two); each fix is quiet. The counts expected
are worked out by loops over positions."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

FOLDER = Path(__file__).parent / "data" / "cachedrop"


def _window_counts(length: int, window: int) -> list[int]:
    """Keys each position sees in one pass under window(W): a double loop."""
    return [sum(1 for k in range(length) if k <= q and q - k < window) for q in range(length)]


def test_ollama_ring_buffer_sliced_after_it_wrapped(tmp_path):
    # ollama/ollama#15591: 10 prompt tokens, 3 decode steps into a ring of 8, then a turn of 4 tokens: the buffer sliced
    # to [0, idx) keeps 3 keys, so query 13 sees 3 + 1 = 4 keys where one pass over the 17 tokens shows it 8
    flagged = check_bug(tmp_path, "ollama_rotating_kv_cache_concat_drops_window_after_wrap", "window-keys-dropped")
    shown = _window_counts(17, 8)
    seen = [3 + i + 1 for i in range(4)]
    short = sum(1 for i in range(4) if seen[i] < shown[13 + i])
    message = flagged[0]["message"]
    assert f"query 13 of batch row 0 (step 4, query 0 of its 4 behind the cache) sees {seen[0]} keys" in message
    assert f"shows position 13 {shown[13]} keys" in message and f"({short} queries short)" in message, message


def test_a_list_cache_trimmed_to_the_window_less_the_chunk(tmp_path):
    # a cache that keeps window - chunk = 1 key before a chunk of 5 (window 6): the chunk's query i sees i + 2 keys
    flagged = check_bug(tmp_path, "sliding_cache_trimmed_by_the_chunk_twice", "window-keys-dropped", FOLDER)
    shown = _window_counts(14, 6)
    short = 2 * sum(1 for i in range(5) if i + 2 < shown[9 + i])
    message = flagged[0]["message"]
    assert "query 9 of batch row 0 (step 1, query 0 of its 5 behind the cache) sees 2 keys" in message, message
    assert f"shows position 9 {shown[9]} keys" in message and f"({short} queries short)" in message, message
