"""A trace in a screen: calls whose masks are the same grouped into one row, each group's mask named by inspect's
recogniser, and what is wrong with it for the API that applied it: the rules of maskcli.checks given a trace group
(checks/grouped.py), asked of the registry as the group is read (its cells, its name, its scores, its kernel)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from maskcli import tracefile
from maskcli.checks import registry
from maskcli.checks.grouped import Grouped
from maskcli.checks.kernels import top_left_is_causal
from maskcli.checks.registry import as_json, severity
from maskcli.text import Finding, spans, step_text
from maskcli.trace.names import PADDING, also_documents, flags, flipped_keep

NAME_CELLS = 1 << 22  # masks up to this many cells (b*h*Lq*Lk as stored) are named by rebuilding them
NAMED = 100  # groups named and checked one by one (milliseconds each), in the order of their first call; past them a
# group is counted, not named (a program of thousands of distinct masks would spend minutes naming them)


@dataclass
class Group:
    calls: list  # of Call
    name: str  # the expression that rebuilds the mask, with what places it, or why there is none
    expression: str | None
    findings: list[Finding] = field(default_factory=list)
    named: bool = True  # False: past the first NAMED groups, counted (its mask neither named nor checked on its own)

    @property
    def first(self):
        return self.calls[0]

    @property
    def where(self) -> str:
        return where_text([call.where for call in self.calls])

    @property
    def steps(self) -> str:
        return step_text(sorted({call.step for call in self.calls}), self.first.shape[2])

    def json(self) -> dict:
        first = self.first
        return {"where": self.where, "api": first.api, "steps": self.steps, "shape": list(first.shape), "mask": first.mask,
                "expression": self.expression, "name": self.name, "calls": [call.index for call in self.calls],
                "findings": [as_json(f) for f in self.findings], "named": self.named}


def where_text(paths: list[str]) -> str:
    """'layers.{0-4,6-10}.self_attn': paths that differ only in one number, said once."""
    families: dict[str, list[int]] = defaultdict(list)
    order: list[str] = []
    for path in dict.fromkeys(paths):
        match = None
        for match in re.finditer(r"(?:(?<=\.)|^)\d+(?=\.|$)", path):  # the last number that is a whole part
            pass
        if match is None:
            key, number = path, None
        else:
            key = path[: match.start()] + "{}" + path[match.end():]
            number = int(match.group())
        if key not in families:
            order.append(key)
        if number is not None:
            families[key].append(number)
    parts = []
    for key in order:
        numbers = sorted(families[key])
        if not numbers:
            parts.append(key)
        elif len(numbers) == 1:
            parts.append(key.replace("{}", str(numbers[0])))
        else:
            parts.append(key.replace("{}", "{" + spans(numbers).replace(", ", ",") + "}"))  # (one word: never wrapped)
    return ", ".join(parts)


def group(calls: list, named: int | None = None, run=None) -> list[Group]:
    """Calls with the same mask, API and shape form one group, in the order of their first call; the first `named`
    groups named and checked, the rest counted (Group.named False: `unnamed` says them in one line). `run`
    (maskcli.checks.context.Run): the model calls whose stated padding a group's checks read (rows.stated_tokens)."""
    found: dict[tuple, list] = {}
    for call in calls:
        key = (call.mask, call.api, call.shape, *(call.details.get(name) for name in ("error", "q_start", "fill_value", "additive", "score_mod_read")))
        found.setdefault(key, []).append(call)
    named = NAMED if named is None else named
    return [_named(members, run) if number < named else Group(members, f"not named: past the first {named} groups", None, named=False)
            for number, members in enumerate(found.values())]


def unnamed(groups: list) -> str | None:
    """One line for the groups past the first NAMED (Group.named False): how many, their calls, and the findings the
    rules that read every call (maskcli.checks) made on them, counted by code; None where every group is named."""
    from collections import Counter

    rest = [g for g in groups if not g.named]
    if not rest:
        return None
    calls = sum(len(g.calls) for g in rest)
    found = Counter(f"{f.code} ({severity(f)})" for g in rest for f in g.findings)
    said = "; their findings: " + ", ".join(f"{code} x{n}" for code, n in found.most_common()) if found else ""
    return (f"{len(rest):,} more group{'s' if len(rest) != 1 else ''} ({calls:,} call{'s' if calls != 1 else ''}) counted, not "
            f"named: trace names and checks the first {len(groups) - len(rest):,} groups one by one (milliseconds each); "
            f"the rules that read every call read these too{said}; --json (Trace.groups()) lists every group")


def _named(calls: list, run=None) -> Group:
    first = calls[0]
    stored = first.stored
    if stored is None:
        return Group(calls, f"not read: {first.details.get('error')}", None)
    if stored["form"] == "stats":
        return Group(calls, f"not kept ({stored['why']}): {stored['kept']:,} cells attended", None,
                     _found(Grouped(calls, stored, run=run), "cells"))
    b, h = stored["planes"]
    q_len, k_len = first.shape[2:]
    structure, same, other = None, None, None
    if q_len == 0 or k_len == 0 or 0 in first.shape[:2]:  # attention over no token, or a batch of 0 rows (0 heads):
        # nothing to name (its queries, if any, see no key)
        rows = "".join(f"{n} {what}, " for n, what in zip(first.shape[:2], ("batch rows", "heads")) if n == 0)
        group = Group(calls, f"empty: {rows}{q_len} quer{'y' if q_len == 1 else 'ies'}, {k_len} key{'' if k_len == 1 else 's'}", None)
    elif b * h * q_len * k_len <= NAME_CELLS:
        from maskcli.inspect.structure import recognise

        keep4 = tracefile.dense(stored)
        given = first.details.get("key_padding")  # the call's key-padding argument, where its API has one
        structure = recognise(keep4, nearest=True, q_start=first.details.get("q_start"), padding=_stated_padding(first, keep4, given))
        if structure.expression is None and given == {} and "key_padding_mask_dtype" not in first.details:
            # MHA given no key_padding_mask: its padding may be in attn_mask (a (B * heads, L, S) causal | padding)
            again = recognise(keep4, nearest=True, q_start=first.details.get("q_start"))
            structure = again if again.expression is not None else structure
        if structure.expression is not None:
            name = structure.expression + flags(structure.options, q_len, k_len)
            group = Group(calls, name, structure.expression)
            if top_left_is_causal(first, q_len, k_len):  # one row of is_causal: its query 0 sees key 0 only,
                group = Group(calls, "causal" + flags({"kv_len": k_len}, q_len, k_len), "causal")  # no decode step's mask
            elif structure.expression == "causal" and q_len == 1 and not _decode_step(calls):
                group = Group(calls, "full" + flags(structure.options, q_len, k_len), "full")  # (one query of a
                # cross-attention that sees every key: no position of its among them, so no causal step's)
            elif structure.kind == "padding" and q_len == 1:  # a decode step read as key padding: a window says more,
                window = _decode_window(keep4, given)  # and one query at the last position sees what causal lets it
                padded = {key: value for key, value in structure.options.items() if key in PADDING}
                kind = "causal" if _decode_step(calls) else "padding"
                group = Group(calls, window, window.split(" ")[0]) if window else Group(calls, kind + flags(padded, q_len, k_len), kind)
        else:
            closest = structure.closest
            near = f"; closest {closest['expression']}, {closest['cells_apart']} cells apart" if closest else ""
            group = Group(calls, f"no expression rebuilds it{near}", None)
        same = lambda: also_documents(structure, keep4, q_len, k_len)  # noqa: E731

        def other():  # the mask read the other way round (the padding is not what is flipped): its kind and name
            flipped = recognise(flipped_keep(keep4, given), padding=given)
            return flipped.kind, None if flipped.expression is None else flipped.expression + flags(flipped.options, q_len, k_len)
    else:
        named = _name_on_intervals(stored, q_len, k_len, _documents(first))
        if named is not None:
            group = Group(calls, named[0] + named[1], named[0])
        else:
            group = Group(calls, f"not named: {q_len:,} x {k_len:,} cells are too many to rebuild cell by cell, "
                                 "and it is none of full, causal, a window", None)
    seen = Grouped(calls, stored, structure, group.name, same, other, run)
    cells = ("cells",) if q_len and k_len else ()  # (no token: no row to see nothing, no later key)
    group.findings = _found(seen, *cells, "named", "scores", "kernel")
    return group


def _found(seen: Grouped, *given: str) -> list[Finding]:
    """The findings of every rule given a trace group at each of `given`, in that order (checks/registry.py)."""
    return [f for each in given for f in registry.run(each, seen)]


def _documents(call) -> str | None:
    """'document(sizes=[...])' where the call packed sequences that are the same for queries and keys (flash_attn's
    cu_seqlens, HF's cu_seq_lens; kept in the details where they are few) and cover every position."""
    found = call.details
    cu_q, cu_k = found.get("cu_seqlens_q", found.get("cu_seq_lens_q")), found.get("cu_seqlens_k", found.get("cu_seq_lens_k"))
    if not isinstance(cu_q, list) or cu_q != cu_k or len(cu_q) < 2 or cu_q[0] != 0 or cu_q[-1] != call.shape[2]:
        return None
    sizes = np.diff(cu_q)
    return f"document(sizes=[{','.join(map(str, sizes.tolist()))}])" if (sizes > 0).all() else None


def _name_on_intervals(stored: dict, q_len: int, k_len: int, documents: str | None = None) -> tuple[str, str] | None:
    """(expression, placement words) of a long mask the same for every batch row and head, compared on key
    intervals (O(L), exact): full, causal or window(W) with the queries at the end of the keys, causal top-left,
    or the call's own packed documents (and a window in them)."""
    from maskcli.errors import MaskError
    from maskcli.mask import MaskOptions, build

    found = tracefile.intervals(stored)
    if found is None or stored["planes"] != [1, 1] or q_len > k_len:
        return None
    width = int(found.counts().max())
    end = MaskOptions(length=q_len, offset=(k_len - q_len) or None)
    top_left = MaskOptions(length=q_len, kv_len=k_len)
    candidates = [("full", end, ""), ("causal", end, ""), (f"window({width})", end, ""), ("causal", top_left, flags({"kv_len": k_len}, q_len, k_len))]
    if documents is not None:
        candidates += [(documents, end, ""), (f"{documents} & window({width})", end, "")]
    for expression, options, words in candidates:
        try:
            built = build(expression, options).intervals()
        except MaskError:
            continue
        if (built.k_start, built.k_end) != (0, k_len):
            continue
        if int((found & ~built).counts().sum()) == 0 and int((built & ~found).counts().sum()) == 0:
            return expression, words
    return None


def _stated_padding(call, keep: np.ndarray, given: dict | None) -> dict | None:
    """The padding the program stated: its key-padding argument, or a mask argument with one row of keys for every query
    (details mask_rows: SDPA's attn_mask (B, 1, 1, Lk), a masked_fill before a softmax): that row's masked keys."""
    if given is not None or call.details.get("mask_rows") != 1:
        return given
    from maskcli.keypadding import options

    valid = keep[:, 0, 0]
    return {} if valid.all() or not valid.any(axis=1).all() else options(valid)


def _decode_step(calls: list) -> bool:
    """Whether a one-query mask over padded keys reads as a decode step of causal self-attention, not key padding over
    another sequence's keys (the same cells): no call is cross-attention by its module (checks.context.cross: T5's
    EncDecAttention, the Annotated Transformer's src_attn) or says it is not causal (Hugging Face's is_causal False).
    (Keys that stay as many across steps say nothing: a rolling cache's do too.)"""
    from maskcli.checks.context import cross

    return not any(cross(call) or call.details.get("hf", {}).get("module_is_causal") is False for call in calls)


def _decode_window(keep: np.ndarray, given: dict | None) -> str | None:
    """'window(W)' (with the call's key padding, maskcli.keypadding's rule) where it rebuilds a one-query mask exactly."""
    from maskcli.errors import MaskError
    from maskcli.keypadding import of
    from maskcli.testing import against

    width = int(keep.sum(axis=-1).max())
    if width < 1 or width == keep.shape[-1]:
        return None  # every key: the causal decode step, which the recogniser names itself
    padding = of(keep, given)
    try:
        equal = against(keep, f"window({width})", **padding).equal
    except MaskError:
        return None
    return f"window({width})" + flags(padding, *keep.shape[2:]) if equal else None


def text(groups: list[Group], calls: int) -> str:
    """The report as plain lines (Trace.report())."""
    lines = [f"{calls} attention call{'s' if calls != 1 else ''} in {len(groups)} group{'s' if len(groups) != 1 else ''}"]
    for number, g in enumerate(groups):
        if not g.named:
            continue
        shape = "(" + ", ".join(map(str, g.first.shape)) + ")"
        lines.append(f"{number}. {g.where} · {g.first.api} · {g.steps} · {shape} · {g.name}")
        lines += [f"   {f.code}: {f.message}" for f in g.findings]
    rest = unnamed(groups)
    return "\n".join(lines if rest is None else [*lines, rest])
