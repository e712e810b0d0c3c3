"""checks/ragged.py: lengths a call site runs over one sequence at a time (a ragged batch packed with no padding)."""

from __future__ import annotations

from types import SimpleNamespace

from maskcli.checks.context import Run


def _call(where: str, keys: int, rows: int = 1):
    return SimpleNamespace(where=where, shape=(rows, 1, keys, keys), stored=object(), details={}, index=0)


def test_one_call_per_length_is_one_at_a_time_and_a_padded_batch_is_not():
    from maskcli.checks.ragged import one_at_a_time

    loop = [_call("attn", n) for n in (9, 5, 7)]
    assert one_at_a_time(Run(calls=loop), loop[0], [9, 5, 7])
    assert one_at_a_time(Run(calls=loop * 2), loop[0], [9, 5, 7])  # two forwards of the same batch
    assert one_at_a_time(Run(calls=loop), loop[0], [9, 9, 5, 5, 7, 7])  # lengths folded with two heads each
    padded = [_call("attn", 9)]
    assert not one_at_a_time(Run(calls=padded), padded[0], [9, 5, 7])
    chunks = [_call("attn", n) for n in (4, 8, 12)]  # a chunked prefill of a padded batch of 8 and 12: not a loop
    assert not one_at_a_time(Run(calls=chunks), chunks[1], [8, 12])
    other = [_call("attn", 9), _call("other", 5), _call("attn", 7)]  # another site's calls are not this site's
    assert not one_at_a_time(Run(calls=other), other[0], [9, 5, 7])
    assert not one_at_a_time(Run(calls=loop), loop[0], [9, 9])  # one length: no ragged batch to tell
