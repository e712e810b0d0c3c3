"""trace/slotwrites.py: the cache slots a step wrote into a buffer it hands attention whole, read off where the buffer
changed since its call site's last call (compared here with the slots written, by a plain loop over the writes)."""

from __future__ import annotations

import torch

from maskcli.trace import slotwrites
from maskcli.trace.keyreads import key_reads


def _step(k_buf, v_buf, rows_at: list[int], q_len: int) -> dict:
    """Write q_len new keys at each row's slot in place, then read the call as trace does."""
    for b, at in enumerate(rows_at):
        for i in range(q_len):
            k_buf[b, :, at + i] = torch.randn(k_buf.shape[1], k_buf.shape[3])
            v_buf[b, :, at + i] = torch.randn(v_buf.shape[1], v_buf.shape[3])
    return slotwrites.written(q_len, k_buf, v_buf, tuple(k_buf.shape))


def test_the_slots_each_row_wrote_since_the_last_call_over_the_same_buffer():
    torch.manual_seed(0)
    slotwrites._SEEN.clear()
    k_buf, v_buf = torch.zeros(2, 2, 12, 4), torch.zeros(2, 2, 12, 4)
    assert _step(k_buf, v_buf, [0, 0], 5) == {}  # the buffer's first call: nothing to compare with
    # (row 1 wrote slot 7 over a prompt of 5: slots 5-6 hold nothing after slots that hold keys, its "gaps")
    assert _step(k_buf, v_buf, [5, 7], 1) == {"written": [[5, 6], [7, 8]], "gaps": [[], [5, 6]]}
    assert _step(k_buf, v_buf, [6, 8], 2) == {"written": [[6, 8], [8, 10]], "gaps": [[], [5, 6]]}
    assert _step(k_buf, v_buf, [8, 3], 1) == {"written": [[8, 9], [3, 4]]}
    assert slotwrites.written(1, k_buf, v_buf, tuple(k_buf.shape)) == {}  # nothing written: no statement
    k_buf[0, :, 9], k_buf[0, :, 11] = 1.0, 2.0  # two slots apart for one query: not its own
    k_buf[1, :, 4] = 1.0
    assert slotwrites.written(1, k_buf, v_buf, tuple(k_buf.shape)) == {}
    new = torch.randn(2, 2, 12, 4)  # a new tensor each step (a dynamic cache's cat): another buffer
    assert key_reads(torch.randn(2, 2, 1, 4), new, new.clone(), tuple(new.shape)).get("written") is None
    assert slotwrites.written(12, k_buf, v_buf, (2, 2, 12, 4)) == {}  # as many queries as keys: no cache


def test_a_trace_that_ends_lets_its_buffers_go():
    """A buffer freed after one trace may come back at the same address and shape in the next: its first call there
    compares with nothing (the earlier trace's checksums would have named slots that differ by chance)."""
    import maskcli

    torch.manual_seed(0)
    k_buf, v_buf = torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4)
    with maskcli.trace():
        k_buf[:, :, :4] = torch.randn(1, 1, 4, 4)
        torch.nn.functional.scaled_dot_product_attention(torch.randn(1, 1, 1, 4), k_buf, v_buf)
        assert slotwrites._SEEN  # the buffer's checksums, kept for its next call
    assert slotwrites._SEEN == {}
    assert _step(k_buf, v_buf, [5], 1) == {}
