"""--expect PATTERN=EXPR: every call whose module path matches is compared with the expression at its positions."""

from __future__ import annotations

from fnmatch import fnmatchcase

from maskcli.errors import MaskError
from maskcli.testing import against
from maskcli.text import spans, step_label
from maskcli.trace.names import flags


def parse(values: list[str], example: str = "layers.*.self_attn=causal", matched: str = "module paths") -> list[tuple[str, str]]:
    """(pattern, expression) pairs; a bad one (its syntax, a kind's name or parameters) is a one-line error before the
    program runs, as `trace` and `model` both check them."""
    from maskcli.expression import parse as parse_expression
    from maskcli.terms import resolve

    pairs = []
    for value in values:
        pattern, equals, expression = value.partition("=")
        if not equals or not pattern.strip() or not expression.strip():
            raise MaskError(f"--expect {value!r}: give PATTERN=EXPR, like \"{example}\" (PATTERN matches {matched} as a shell does)")
        try:
            resolve(parse_expression(expression), {}, expression.strip())  # no flags here: a bare window needs (W)
        except MaskError as error:
            raise MaskError(f"--expect {value!r}: {error}") from None
        pairs.append((pattern.strip(), expression.strip()))
    return pairs


def check(calls: list, expectations: list[tuple[str, str]], names=lambda call: (call.where,), placed=lambda call: {}) -> list[str]:
    """Lines on what differs: for each expectation its first differing call with its first differing rows, then the
    other differing calls by index (and a pattern that matched nothing); empty when every expectation holds.
    A pattern matches a call where it matches any of `names(call)` (its module path; `model` adds its layer type);
    `placed(call)` may place its queries among its keys (offset=, kv_len=) where they are not at the keys' end."""
    from maskcli.diff import row_words
    from maskcli.testing import keep_array, padding as found_padding

    lines = []
    for pattern, expression in expectations:
        head = f"--expect {pattern}={expression}"
        matched = [call for call in calls if any(fnmatchcase(name, pattern) for name in names(call))]
        if not matched:
            known = ", ".join(sorted({name for call in calls for name in names(call)})[:6]) or "no calls at all"
            lines.append(f"{head}: no call matches {pattern!r} (calls came from {known})")
            continue
        differing = []
        for call in matched:
            step = call.details.get("step_name") or step_label(call.step, call.shape[2])  # (model names its own)
            where = f"call {call.index} ({call.where} {step}, {call.api})"
            try:
                keep = keep_array(call)
                padding = found_padding(keep, call, {})  # (maskcli.keypadding's rule, as assert_mask's)
                difference = against(keep, expression, f"call {call.index}", **padding, **placed(call))
            except MaskError as error:
                lines.append(f"{head}: {where}: cannot compare: {error}")
                continue
            if difference.equal:
                continue
            differing.append(call.index)
            if len(differing) == 1:
                pad = f" with the padding found{flags(padding, *call.shape[2:])}" if padding else ""
                rows = row_words(difference, "the call", expression)[:2]
                lines.append(f"{head}: {where} differs from {expression}{pad}: {'; '.join(rows)}")
        if len(differing) > 1:
            more = len(differing) - 1
            lines.append(f"{head}: {more} more {'call differs' if more == 1 else 'calls differ'}: {spans(differing[1:])}")
    return lines
