"""--expect PATTERN=EXPR for a serving batch: each matching request's mask compared with EXPR at its positions.

PATTERN is a shell pattern over a request's names: its index in the batch, and its request id
where the batch has request_ids ("*" is every request). The expression is built on the
request's own frame (queries at seq_len - new .. seq_len - 1, keys 0 .. seq_len - 1) and
compared by key intervals, O(queries) per request.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from maskcli.errors import MaskError
from maskcli.serve.batch import ServeBatch
from maskcli.serve.checks import Finding
from maskcli.text import spans


def names(b: ServeBatch, r: int) -> tuple[str, ...]:
    return (str(r),) if b.request_ids is None else (str(r), str(int(b.request_ids[r])))


def expect(b: ServeBatch, expectations: list[tuple[str, str]]) -> list[Finding]:
    """One finding per expectation that does not hold: its first differing request with the first differing cell,
    and how many more differ; a pattern that matches no request is one too."""
    out = []
    for pattern, expression in expectations:
        head = f"--expect {pattern}={expression}"
        matched = [r for r in range(b.requests) if any(fnmatchcase(name, pattern) for name in names(b, r))]
        if not matched:
            known = "request indexes 0 to " + str(b.requests - 1) if b.requests else "no requests at all"
            out.append(Finding("expect", f"{head}: no request matches {pattern!r} (the batch has {known})"))
            continue
        found = first_difference(b, matched, expression, head)
        if found is not None:
            out.append(found)
    if expectations and not out:
        count = len(expectations)
        out.append(Finding("expect", f"--expect: every request matched holds ({count} expectation{'s' * (count != 1)})", "note"))
    return out


def first_difference(b: ServeBatch, requests: list[int], expression: str, head: str, code: str = "expect",
                     actual: str | None = None) -> Finding | None:
    """The first of `requests` whose mask (or the mask `actual` makes at its positions) is not `expression` at its
    positions, as a finding (severity wrong) that counts the others; None where all hold."""
    differing, first = [], None
    for r in requests:
        if code != "expect" and b.mask(r) is None:
            continue  # a request with no mask is the length rules' finding; only --expect asks for every one
        found = _differs(b, r, expression, head, actual)
        if found is not None:
            differing.append(r)
            first = first or found
    if first is None:
        return None
    more = f"; {len(differing) - 1} more differ: requests {spans(differing[1:])}" if len(differing) > 1 else ""
    return Finding(code, first.message + more, first.severity, request=first.request, cell=first.cell)


def _differs(b: ServeBatch, r: int, expression: str, head: str, actual: str | None = None) -> Finding | None:
    from maskcli.diff import compare, row_words
    from maskcli.mask import build

    mask = b.mask(r)
    if mask is not None and actual is not None:
        q_start, q_len, seq_len = b.frame(r)
        mask = build(actual, offset=q_start, length=q_len, kv_len=seq_len)
    if mask is None:
        q_start, q_len, seq_len = b.frame(r)
        if q_len == 0:
            return None  # no queries: nothing to hold
        return Finding("expect", f"{head}: request {r} has {q_len} queries and {seq_len} keys: no mask to compare", request=r)
    q_start, q_len, seq_len = b.frame(r)
    try:
        expected = build(expression, offset=q_start, length=q_len, kv_len=seq_len)
    except MaskError as error:
        return Finding("expect", f"{head}: request {r}: cannot build it there: {error}", request=r)
    difference = compare(mask, expected, first=1)
    if difference.equal:
        return None
    row = difference.rows[0]
    key = min(start for start, _ in row.only_a + row.only_b)
    words = row_words(difference, f"request {r}", expression)[0]
    return Finding("expect", f"{head}: request {r} ({actual or b.expression(r)}) differs: {words}", request=r, cell=(row.query, key))
