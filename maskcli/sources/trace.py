"""A mask from a trace file: the call `TRACE.pt:SELECTOR` names (maskcli trace --save wrote it), in keep form.

A call is named by its index, MODULE_PATH@STEP, FILE.py:LINE, or rankR:... in a trace of several ranks. The file
itself (its stored forms and their checks) is tracefile.py's.
"""

from __future__ import annotations

import numpy as np

from maskcli import tracefile
from maskcli.errors import MaskError
from maskcli.mask import Mask, MaskOptions
from maskcli.sources.base import Source


def split_spec(text: str) -> tuple[str, str] | None:
    """('TRACE.pt', '7') for 'TRACE.pt:7', 'TRACE.pt:layers.5.self_attn@2' or 'TRACE.pt:script.py:9' (a call named
    by the file and line it came from has a colon of its own); None where it is not that form."""
    at = text.lower().find(".pt:")
    if at < 0:
        return None
    path, selector = text[: at + 3], text[at + 4 :]
    if not selector or "/" in selector:
        return None
    return path, selector


def select(data: dict, selector: str, path: str) -> dict:
    """The call a selector names: its index, or WHERE@STEP; in a trace of several ranks, rankR:INDEX or
    rankR:WHERE@STEP names one of rank R's calls (INDEX counts that rank's calls alone)."""
    import re

    calls = data["calls"]
    ranked = re.fullmatch(r"rank([0-9]+):(.+)", selector)
    if ranked is None:
        return _select(calls, selector, path, path)
    rank, rest = _whole(ranked[1], path, selector), ranked[2]
    known = sorted({call["rank"] for call in calls if "rank" in call})
    if not known:
        raise MaskError(f"{path}:{selector}: the trace is of one process, with no ranks: name the call as {path}:{rest}")
    if rank not in known:
        raise MaskError(f"{path}:{selector}: the trace has calls of rank {', '.join(map(str, known))}, not rank {rank}")
    return _select([call for call in calls if call.get("rank") == rank], rest, f"{path}:rank{rank}", path)


def _select(calls: list[dict], selector: str, named: str, path: str) -> dict:
    if selector.isascii() and selector.isdigit():  # (str.isdigit takes '²' and '１', which int() refuses or reads)
        index = _whole(selector, named, selector)
        if index >= len(calls):
            raise MaskError(f"{named}:{selector}: the trace has {len(calls)} calls{' of that rank' if named != path else ''}, numbered 0 to {len(calls) - 1}")
        return calls[index]
    where, at, step = selector.rpartition("@")
    if not at:  # WHERE alone: its one call
        found = [call for call in calls if call["where"] == selector]
        if len(found) == 1:
            return found[0]
        _one_rank(found, named, selector)
        if found:
            steps = ", ".join(str(call["step"]) for call in found[:8])
            raise MaskError(f"{named}:{selector}: {selector} made {len(found)} calls (steps {steps}): name one as {named}:{selector}@STEP")
    if not at or not (step.isascii() and step.isdigit()):
        raise MaskError(f"{named}:{selector!r}: name a call by its index (like {named}:7) or as MODULE_PATH@STEP (like {named}:layers.5.self_attn@2)")
    found = [call for call in calls if call["where"] == where and call["step"] == _whole(step, named, selector)]
    _one_rank(found, named, selector)
    if found:
        return found[0]
    known = sorted({call["where"] for call in calls})
    shown = ", ".join(known[:6]) + (", ..." if len(known) > 6 else "")
    raise MaskError(f"{named}:{selector}: no call of {where!r} at step {step}; the trace has calls of {shown or 'nothing'}")


def _whole(digits: str, named: str, selector: str) -> int:
    """An index, rank or step as an int; past 18 digits (int() refuses 4,301) no trace numbers that many."""
    if len(digits) > 18:
        from maskcli.text import shortened

        raise MaskError(f"{named}:{shortened(selector, 60)!r}: {len(digits):,} digits name no call, rank or step of a trace: "
                        f"name a call by its index, like {named}:0")
    return int(digits)


def _one_rank(found: list[dict], named: str, selector: str) -> None:
    """A name that several ranks' calls answer to is refused: which rank's is meant?"""
    ranks = sorted({call["rank"] for call in found if "rank" in call})
    if len(ranks) > 1:
        raise MaskError(f"{named}:{selector}: ranks {', '.join(map(str, ranks))} each made that call: "
                        f"name one rank's as {named}:rank{ranks[0]}:{selector}")


def traced_details(text: str) -> dict:
    """The details of the call 'TRACE.pt:SELECTOR' names (its key_padding argument, ...); {} where it names none."""
    if not claims(text):
        return {}
    spec = split_spec(text)
    return dict(select(tracefile.load(spec[0]), spec[1], spec[0]).get("details", {}))


def traced_keep(text: str) -> tuple[np.ndarray, str] | None:
    """(keep (B, H, Lq, Lk), label) of the call 'TRACE.pt:SELECTOR' names; None where `text` is no such name
    (an existing file of that name, or no trace file before the colon)."""
    if not claims(text):
        return None
    path, selector = split_spec(text)
    data = tracefile.load(path)
    call = select(data, selector, path)
    if 0 in call["shape"]:  # attention over no token, or a batch of 0 rows: a mask of no cells (report: "empty")
        raise MaskError(f"{path}:{selector}: that call's mask has shape {list(call['shape'])}, no cells (attention over "
                        "nothing): name another call of the trace, one over tokens")
    keep = np.ascontiguousarray(np.broadcast_to(tracefile.keep_of(call, data), call["shape"]))
    from maskcli.text import step_label

    step = call.get("details", {}).get("step_name") or step_label(call["step"], call["shape"][2])
    rank = f"rank {call['rank']} " if "rank" in call else ""
    return keep, (f"{path}:{selector} ({rank}call {call.get('index', selector)}, {call['where']} {step}, "
                  f"{call.get('api', 'an unnamed API')})")


def load(spec: str, options: MaskOptions, flag: str = "--mask") -> Mask:
    """The Mask of the call `spec` names, placed as a tensor file's is (--offset, --kv-start, --heads)."""
    from maskcli.sources.tensor import placed

    for option, value in (("--key", options.key), ("--from", options.from_)):
        if value is not None:
            raise MaskError(f"{option} does not apply to {spec!r}: a traced call's mask is already in keep form; drop {option}")
    keep, label = traced_keep(spec)
    return placed(keep, label, spec, options)


def claims(text: str, options: MaskOptions | None = None) -> bool:
    """`text` names a call of a trace file (TRACE.pt:SELECTOR), not a file of that name."""
    import os

    spec = split_spec(text)
    return spec is not None and not os.path.exists(text) and os.path.isfile(spec[0])


SOURCE = Source("trace", load, claims)
