"""Masks of two kinds read off a keep matrix, for masks no single kind rebuilds, and the closest kind.

Like single kinds, each candidate is only a guess until maskcli rebuilds it and it equals
the tensor cell for cell. Each is a tree of terms (kinds bound to the values read), built with no text to parse:
structure.py makes text only of the one that rebuilds the tensor, to show. The shapes looked for are those of
real models:

    document(labels) & window(W)     packed sequences with a sliding window
    causal | blocks(ids)             causal text with bidirectional image tokens (Gemma 3)
    causal & (window(W) | sink(S))   StreamingLLM's sinks beside a window
"""

from __future__ import annotations

import functools

import numpy as np

from maskcli.expression import And, Or, both, either
from maskcli.inspect.candidates import ruled_out
from maskcli.kinds import get as get_kind
from maskcli.kinds.base import Profile
from maskcli.kinds.values import inline
from maskcli.terms import bound_each

NAMES = ("document", "window", "causal", "blocks", "sink")  # the kinds the forms join


@functools.cache
def _kinds() -> dict:
    """Each kind the forms join, looked up once."""
    return dict(zip(NAMES, map(get_kind, NAMES)))


def _labels(labels: np.ndarray):
    return inline([labels.tolist()], "recognised labels")


def _window(profile: Profile) -> int | None:
    rows = profile.seen
    if not rows.any():
        return None
    return int((profile.q - profile.first)[rows].max()) + 1


def document_window(profile: Profile, _cells, k: dict):
    """Documents start where a row sees only itself; the window is the widest look-back."""
    width = _window(profile)
    if width is None or width < 2 or not profile.seen.all() or profile.q[0] != 0 or len(profile.q) != profile.k_end:
        return
    starts = profile.first == profile.q
    starts[0] = False
    document, window = bound_each([(k["document"], {"labels": _labels(np.cumsum(starts))}), (k["window"], {"window": width})])
    if document is not None and window is not None:
        yield "document", both(document, window)


def causal_blocks(profile: Profile, _cells, k: dict):
    """Rows that see past themselves belong to a block that ends at the last key they see."""
    if not (profile.first == profile.k_start).all() or profile.q[0] != 0 or len(profile.q) != profile.k_end:
        return
    ids = np.full(len(profile.q), -1, dtype=np.int64)
    ends = profile.last[profile.last > profile.q]
    for number, end in enumerate(np.unique(ends)):  # one pass per block of the tensor, not per token
        members = (profile.last == end) & (profile.q <= end)
        start = int(np.flatnonzero(members)[0])
        ids[start : int(end) + 1] = number
    if (ids >= 0).any():
        causal, blocks = bound_each([(k["causal"], {}), (k["blocks"], {"labels": _labels(ids)})])
        if blocks is not None:
            yield "blocks", either(causal, blocks)


def composites(profile: Profile, cells: np.ndarray, lacks: frozenset[str] = frozenset()) -> list:
    """(kind, tree of terms) of two-kind masks worth rebuilding, for one (Lq, Lk) keep matrix. A form whose masks all
    hold what the matrix lacks (`lacks`: candidates.lacking at its positions) is not read: its trees, bound and
    placed, would be ruled out (candidates.ruled_out reads a form's kinds as it reads a tree's)."""
    k = _kinds()
    found = []
    for form, read in FORMS:
        if not (lacks and ruled_out(form(k), lacks)):
            found += read(profile, cells, k)
    return found


def _streaming(profile: Profile, cells: np.ndarray, k: dict):
    """causal & (window(W) | sink(S)): in the last row, S leading keys, a gap, then the W keys of its window."""
    if not profile.seen.all():
        return
    last_row = cells[-1].astype(np.int8)
    edges = np.diff(last_row, prepend=0, append=0)
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if len(starts) == 2 and starts[0] == 0:
        causal, window, sink = bound_each([(k["causal"], {}), (k["window"], {"window": int(ends[1] - starts[1])}),
                                           (k["sink"], {"sink": int(ends[0])})])
        if window is not None and sink is not None:
            yield "sink", both(causal, either(window, sink))


# each form: its kinds joined as its trees join them ((And | Or, Kind, ...), for candidates.ruled_out), and its reader
FORMS = ((lambda k: (And, k["document"], k["window"]), document_window),
         (lambda k: (Or, k["causal"], k["blocks"]), causal_blocks),
         (lambda k: (And, k["causal"], (Or, k["window"], k["sink"])), _streaming))
