"""--expect PATTERN=EXPR: every call whose module path matches is compared with the expression at its positions.

One semantics, the checks' own: what the run states is read from the run and held at every step, and EXPR says
the rest. The run states where each call's queries sit among its keys (its cache: checks.context.queries; a
cross-attention's queries sit apart from its memory) and its padding: the model call's 2-D `attention_mask`, else
the call's own key-padding argument (nn.MultiheadAttention's key_padding_mask), else the keys the call site's prefill
masks as padding, held behind the cache at each decode step (the keys after them are tokens generated since); only
where none says any is it read off the call (maskcli.keypadding). A query row that is itself padding is not compared:
what a kernel gives it is the kernel's, and its output is discarded.

EXPR may end in the padding its name carries, as trace prints it: `causal (--lengths 2,4 --pad left)` or
`causal (--ids 0,0,5,6;7,8,9,10)`. That padding is the prompt's, stated exactly: it replaces the run's, its keys
stay padding at every later step, and its padding query rows are compared too.
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


def check(calls: list, expectations: list[tuple[str, str]], names=lambda call: (call.where,), placed=lambda call: {},
          tops: list | None = None) -> list[str]:
    """Lines on what differs: for each expectation its first differing call with its first differing rows, then the
    other differing calls by index (and a pattern that matched nothing); empty when every expectation holds.
    A pattern matches a call where it matches any of `names(call)` (its module path; `model` adds its layer type);
    `placed(call)` may place its queries among its keys (offset=, kv_len=) where they are not at the keys' end;
    `tops`: the run's model calls (trace's), from which placement and padding are read where `placed` says none."""
    from maskcli.diff import row_words
    from maskcli.testing import keep_array

    states = _run_states(calls, tops or [])
    lines = []
    for pattern, written in expectations:
        head = f"--expect {pattern}={written}"
        expression, stated = stated_padding(written)
        matched = [call for call in calls if any(fnmatchcase(name, pattern) for name in names(call))]
        if not matched:
            known = ", ".join(sorted({name for call in calls for name in names(call)})[:6])
            lines.append(f"{head}: no call matches {pattern!r} "
                         f"({f'calls came from {known}' if known else 'no attention call was recorded'})")
            continue
        differing = []
        for call in matched:
            step = call.details.get("step_name") or step_label(call.step, call.shape[2])  # (model names its own)
            where = f"call {call.index} ({call.where} {step}, {call.api})"
            try:
                keep = keep_array(call)
                state = states.get(call.index) or _State()
                position = placed(call) or state.placement
                if stated:  # the prompt's padding, held at every step (a mask one row for all: each row's)
                    keep = np.broadcast_to(keep, (max(keep.shape[0], call.shape[0]),) + keep.shape[1:])
                    padding, source = _padding_at(stated, keep.shape[0], keep.shape[-1]), "stated"
                else:
                    keep, padding, source = _run_padding(keep, call, state, expression, position)
                difference = against(keep, expression, f"call {call.index}", **padding, **position)
            except MaskError as error:
                lines.append(f"{head}: {where}: cannot compare: {error}")
                continue
            if difference.equal:
                continue
            differing.append(call.index)
            if len(differing) == 1:
                pad = f" with the padding {source}{flags(padding, *call.shape[2:])}" if padding else ""
                rows = row_words(difference, "the call", expression)[:2]
                lines.append(f"{head}: {where} differs from {expression}{pad}: {'; '.join(rows)}")
        if len(differing) > 1:
            more = len(differing) - 1
            lines.append(f"{head}: {more} more {'call differs' if more == 1 else 'calls differ'}: {spans(differing[1:])}")
    return lines


class _State:
    """What the run states of one call: where its queries sit (MaskOptions fields), its real keys (B, Lk) and what
    says so, and each query row's position (None: its queries are no key positions, as a cross-attention's)."""

    def __init__(self, placement: dict | None = None, valid: np.ndarray | None = None, source: str = "", own=None):
        self.placement, self.valid, self.source, self.own = placement or {}, valid, source, own


def _run_states(calls: list, tops: list) -> dict:
    """Each call's _State; a site's prefill padding carried to the decode steps after it (as checks/steps.py does)."""
    from maskcli.checks.context import Run, columns_are_positions, cross, keep, queries
    from maskcli.keypadding import read, valid as valid_of

    run, found, prefills = Run(list(calls), list(tops)), {}, {}
    for call in calls:
        if call.stored is None or call.shape[3] == 0:
            continue
        q_len, k_len = call.shape[2:]
        if cross(call):  # its queries sit apart from its memory: compared top-left; the memory's padding read off it
            found[call.index] = _State({"offset": 0, "kv_len": k_len})
            continue
        top = run.top(call)
        if not columns_are_positions(call, top):  # (a sliding cache's columns: its queries at the keys' end)
            continue
        own = queries(call, top)
        placement = {} if int(own[0]) == k_len - q_len else {"offset": int(own[0]), "kv_len": k_len}
        state = found[call.index] = _State(placement, own=own)
        mask = None if top is None or getattr(top.config, "is_encoder_decoder", False) else top.arguments.get("attention_mask")
        # (an encoder-decoder's attention_mask is its source's: not the decoder's keys)
        if call.details.get("key_padding"):
            continue  # the call's own key-padding argument says it (maskcli.keypadding's rule 2)
        if isinstance(mask, np.ndarray) and mask.ndim == 2 and mask.shape[1] <= k_len and mask.shape[0] == call.shape[0]:
            state.valid = np.concatenate([mask != 0, np.ones((mask.shape[0], k_len - mask.shape[1]), bool)], axis=1)
            state.source = f"of {top.where}'s attention_mask"  # (a static cache's slots past it: later keys, not padding)
        elif own[0] == 0:  # a prefill: the keys it masks as padding, held at the decode steps after it
            cells = keep(call)
            prefills[call.where] = (call, {} if cells is None else read(cells))
        elif prefills.get(call.where, (None, {}))[1]:
            head, fields = prefills[call.where]
            prompt = valid_of(fields, head.shape[0], head.shape[3])
            if prompt.shape[1] <= k_len and prompt.shape[0] == call.shape[0]:
                state.valid = np.concatenate([prompt, np.ones((prompt.shape[0], k_len - prompt.shape[1]), bool)], axis=1)
                state.source = f"of step {head.step}"
    return found


def _run_padding(keep: np.ndarray, call, state: _State, expression: str, position: dict) -> tuple:
    """(keep with its padding query rows set to the expression's, the padding's MaskOptions fields, what says so)."""
    from maskcli.keypadding import of, options, valid as valid_of
    from maskcli.testing import expected_cells

    if state.valid is None:
        given = call.details.get("key_padding") or None  # (MHA given none may carry it in attn_mask: read off the mask)
        padding, source = of(keep, given), "of its key_padding_mask" if given else "found"
        if not padding or state.own is None:
            return keep, padding, source
        real = valid_of(padding, max(keep.shape[0], call.shape[0]), keep.shape[-1])
    else:
        real, source = state.valid, state.source
        padding = options(real) if not real.all() else {}
    if not padding or state.own is None:
        return keep, padding, source
    keep = np.broadcast_to(keep, (real.shape[0],) + keep.shape[1:])
    own = np.asarray(state.own)
    inside = own < real.shape[1]
    padded_rows = np.zeros((real.shape[0], len(own)), bool)
    padded_rows[:, inside] = ~real[:, own[inside]]
    if padded_rows.any():  # a padding query's row is the kernel's (its output discarded): taken as the expression has it
        wanted = np.broadcast_to(expected_cells(keep.shape, expression, **padding, **position), keep.shape)
        rows = np.broadcast_to(padded_rows[:, None, :], keep.shape[:3])
        keep = keep.copy()
        keep[rows] = wanted[rows]
    return keep, padding, source
