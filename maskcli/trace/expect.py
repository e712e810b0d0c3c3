"""--expect PATTERN=EXPR: every call whose module path matches is compared with the expression at its positions.

EXPR may end in the padding its name carries, as trace prints it: `causal (--lengths 2,4 --pad left)` or
`causal (--ids 0,0,5,6;7,8,9,10)`. That padding is the prompt's: its keys stay padding at every later step (the
keys past it are the tokens generated since, all real), so a padding lost at decode fails the expectation. Without
it, each call's padding is read off the call itself (maskcli.keypadding), which a lost padding cannot fail.
"""

from __future__ import annotations

import re
import shlex
from fnmatch import fnmatchcase

import numpy as np

from maskcli.errors import MaskError
from maskcli.testing import against
from maskcli.text import spans, step_label
from maskcli.trace.names import flags


PADDED = re.compile(r"^(?P<expression>.*?)\s*\((?P<flags>\s*--[^()]*)\)\s*$")
PADDING_FLAGS = {"--lengths": "lengths", "--pad": "pad", "--ids": "ids", "--pad-id": "pad_id"}


def stated_padding(expression: str) -> tuple[str, dict]:
    """(the expression, the padding fields its `(--lengths ... --pad ...)` ending states); {} where it has none."""
    found = PADDED.match(expression)
    if found is None:
        return expression, {}
    words, fields = shlex.split(found["flags"]), {}
    while words:
        flag = words.pop(0)
        if flag not in PADDING_FLAGS or not words:
            raise MaskError(f"{flag!r} in {expression!r}: the padding takes --lengths L,L, --pad left|right, --ids "
                            f"ROW;ROW and --pad-id N, each with its value, as trace's names print it")
        fields[PADDING_FLAGS[flag]] = words.pop(0)
    if "lengths" not in fields and "ids" not in fields:
        raise MaskError(f"{expression!r}: give the padding as --lengths L,L (with --pad left) or --ids ROW;ROW")
    if fields.get("pad", "right") not in ("left", "right"):
        raise MaskError(f"--pad {fields['pad']!r} in {expression!r}: give --pad left or --pad right")
    numbers = [(r"\d+(,\d+)*", fields.get("lengths")), (r"-?\d+([,;]-?\d+)*", fields.get("ids")), (r"-?\d+", fields.get("pad_id"))]
    if not all(re.fullmatch(pattern, text) for pattern, text in numbers if text is not None):
        raise MaskError(f"{expression!r}: --lengths, --ids and --pad-id take whole numbers, like --lengths 2,4 or --ids 0,5;7,8")
    if "ids" in fields and len({row.count(",") for row in fields["ids"].split(";")}) > 1:
        raise MaskError(f"--ids {fields['ids']!r} in {expression!r}: give every batch row as many ids")
    if "pad_id" in fields:
        fields["pad_id"] = int(fields["pad_id"])
    return found["expression"], fields


def _prompt_valid(stated: dict) -> np.ndarray:
    """Bool (B, P): the prompt's real keys by the stated padding (maskcli.keypadding's reading), P its length."""
    from maskcli.keypadding import valid

    rows = stated["ids"].split(";") if "ids" in stated else stated["lengths"].split(",")
    width = rows[0].count(",") + 1 if "ids" in stated else max(int(n) for n in rows)
    return valid(stated, len(rows), width)


def _padding_at(stated: dict, batch: int, k_len: int) -> dict:
    """The stated prompt padding for a call of `k_len` keys: the prompt's keys, then real ones (tokens made since)."""
    from maskcli.keypadding import options

    prompt = _prompt_valid(stated)
    if prompt.shape[0] != batch:
        raise MaskError(f"the padding gives {prompt.shape[0]} batch rows and the call has {batch}")
    if prompt.shape[1] > k_len:
        raise MaskError(f"the padding covers {prompt.shape[1]} keys and the call has {k_len}")
    return options(np.concatenate([prompt, np.ones((batch, k_len - prompt.shape[1]), bool)], axis=1))


def parse(values: list[str], example: str = "layers.*.self_attn=causal", matched: str = "module paths",
          padding: bool = True) -> list[tuple[str, str]]:
    """(pattern, expression) pairs; a bad one (its syntax, a kind's name or parameters, its padding) is a one-line
    error before the program runs, as `trace` and `model` both check them. `padding`: EXPR may end in the padding
    its name carries (`causal (--lengths 2,4 --pad left)`)."""
    from maskcli.expression import parse as parse_expression
    from maskcli.terms import resolve

    pairs = []
    for value in values:
        pattern, equals, expression = value.partition("=")
        if not equals or not pattern.strip() or not expression.strip():
            raise MaskError(f"--expect {value!r}: give PATTERN=EXPR, like \"{example}\" (PATTERN matches {matched} as a shell does)")
        try:
            bare = stated_padding(expression)[0] if padding else expression
            resolve(parse_expression(bare), {}, bare.strip())  # no flags here: a bare window needs (W)
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
    for pattern, written in expectations:
        head = f"--expect {pattern}={written}"
        expression, stated = stated_padding(written)
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
                if stated:  # the prompt's padding, held at every step (a mask one row for all: each row's)
                    keep = np.broadcast_to(keep, (max(keep.shape[0], call.shape[0]),) + keep.shape[1:])
                    padding = _padding_at(stated, keep.shape[0], keep.shape[-1])
                else:
                    padding = found_padding(keep, call, {})  # (maskcli.keypadding's rule, as assert_mask's)
                difference = against(keep, expression, f"call {call.index}", **padding, **placed(call))
            except MaskError as error:
                lines.append(f"{head}: {where}: cannot compare: {error}")
                continue
            if difference.equal:
                continue
            differing.append(call.index)
            if len(differing) == 1:
                pad = f" with the padding {'stated' if stated else 'found'}{flags(padding, *call.shape[2:])}" if padding else ""
                rows = row_words(difference, "the call", expression)[:2]
                lines.append(f"{head}: {where} differs from {expression}{pad}: {'; '.join(rows)}")
        if len(differing) > 1:
            more = len(differing) - 1
            lines.append(f"{head}: {more} more {'call differs' if more == 1 else 'calls differ'}: {spans(differing[1:])}")
    return lines
