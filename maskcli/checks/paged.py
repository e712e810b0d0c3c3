"""A sliding layer over a packed batch of sequences, each with keys of its own: the window inside each sequence.

A continuous-batching step or a flash varlen call packs the new tokens of several sequences into one row of
queries and gathers each sequence's keys (its cache and its new tokens) into one row of keys, with the cumulative
lengths of both (`cumulative_seqlens_q/k` as transformers' continuous batching names them, flash's
`cu_seqlens_q/k`, `cu_seq_lens_q/k`). Sequence i's queries are the last len_q(i) of its len_k(i) keys (flash's
bottom-right alignment, the new tokens after the cached ones), so a query's position within its sequence is known
and so is the window its config states: it sees the keys of its own sequence from position p - W + 1 to p and no
other. config.py cannot place that on the packed row (its columns are not one sequence's positions); this module
compares the whole packed mask with it, and says a window one key off, no window at all (causal within each
sequence), or a band on the wrong side (keys behind the window and keys after the query both seen).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.config import COUNTS_QUERY, _index
from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.intent import intent
from maskcli.checks.registry import Rule
from maskcli.text import Finding

PAIRS = (("cumulative_seqlens_q", "cumulative_seqlens_k"), ("cu_seqlens_q", "cu_seqlens_k"),
         ("cu_seq_lens_q", "cu_seq_lens_k"))


def _sequences(top, q_len: int, k_len: int) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(the argument's name, cumulative query lengths, cumulative key lengths) the model call states for these query
    and key counts, each sequence with at least as many keys as queries; None where none fits."""
    for q_name, k_name in PAIRS:
        cu_q, cu_k = top.arguments.get(q_name), top.arguments.get(k_name)
        if not (isinstance(cu_q, np.ndarray) and isinstance(cu_k, np.ndarray)):
            continue
        cu_q, cu_k = cu_q.reshape(-1), cu_k.reshape(-1)
        if len(cu_q) != len(cu_k) or len(cu_q) < 2 or cu_q[0] != 0 or cu_k[0] != 0 or cu_q[-1] != q_len \
                or cu_k[-1] != k_len or (np.diff(cu_q) < 0).any() or (np.diff(cu_k) < np.diff(cu_q)).any():
            continue
        return q_name[: -len("_q")], cu_q, cu_k
    return None


def _expected(cu_q: np.ndarray, cu_k: np.ndarray, size: int | None) -> np.ndarray:
    """Bool (Lq, Lk): each query sees its own sequence's keys from W - 1 positions back to its own (None: causal)."""
    len_q, len_k = np.diff(cu_q), np.diff(cu_k)
    seq_q = np.repeat(np.arange(len(len_q)), len_q)
    seq_k = np.repeat(np.arange(len(len_k)), len_k)
    at_q = np.arange(cu_q[-1]) - cu_q[seq_q] + (len_k - len_q)[seq_q]  # the query's position in its sequence
    at_k = np.arange(cu_k[-1]) - cu_k[seq_k]
    back = at_q[:, None] - at_k[None, :]
    seen = _same(cu_q, cu_k) & (back >= 0)
    return seen if size is None else seen & (back < size)


def windows(run: Run) -> list:
    """Each call of a sliding layer whose model call states packed sequences against their stated window."""
    found, missing, windowed, done = [], [], set(), set()
    if not any(getattr(top, "stated", ()) for top in run.tops):
        return found  # (no config stated anywhere: no call's intent states a window)
    for call in run.calls:
        if call.stored is None:
            continue
        stated = intent(run, call)
        if not stated or stated.window() is None or stated.bidirectional():
            continue
        index = _index(run, call, stated)
        kind = stated.kind(index)
        top = run.top(call)
        if kind is None or kind[0] != "sliding_attention" or top is None:
            continue
        packed = _sequences(top, *call.shape[2:])
        if packed is None or call.mask in done:
            continue
        done.add(call.mask)
        cells = keep(call)
        if cells is None:
            continue
        name, cu_q, cu_k = packed
        size, field = stated.window()
        source = stated.said(field)
        where = f"layer {index}" if index is not None else call.where
        seen = cells.any(axis=(0, 1)) if (cells == cells[:1, :1]).all() else None  # (one mask for every row and head)
        if seen is None:
            continue
        if np.array_equal(seen, _expected(cu_q, cu_k, size)):
            windowed.add(source)
            continue
        said = f"{name}_q/k of {top.where}"
        wider = next((w for w in (size + 1, size - 1) if w >= 1 and np.array_equal(seen, _expected(cu_q, cu_k, w))), None)
        if wider is not None and not np.array_equal(seen, _expected(cu_q, cu_k, None)):
            windowed.add(source)
            found.append((call, Finding("window-off-by-one", (
                f"{where} sees window({wider}) within each packed sequence ({said}), one key "
                f"{'wider' if wider > size else 'narrower'} than its config's window({size}) ({source}): an off-by-one"
                f" ({COUNTS_QUERY})"), severity=None if field == "sliding_window" else "suspicious",
                expected=f"window({size})", source=source)))
            continue
        if np.array_equal(seen, _expected(cu_q, cu_k, None)):
            missing.append((call, kind, Finding("window-missing", (
                f"{where} is a sliding layer ({kind[1]}) but its mask is causal within each packed sequence ({said}): "
                f"queries see keys {size} or more positions back ({source})"), expected=f"window({size})",
                source=source)))
            continue
        causal = _expected(cu_q, cu_k, None)
        behind = seen & causal & ~_expected(cu_q, cu_k, size)
        after = seen & ~causal & _same(cu_q, cu_k)
        if behind.any() and after.any():
            q, k = first_cell(after)
            missing.append((call, kind, Finding("window-misplaced", (
                f"{where} is a sliding layer ({kind[1]}) but within its packed sequences ({said}) queries see keys "
                f"{size} or more positions back ({int(behind.sum())} cells) and keys after their own ({int(after.sum())}"
                f" cells, first query {q} key {k}): the window's band is on the wrong side ({source})"),
                expected=f"window({size})", source=source, cell=(0, q, k))))
    # sliding_window alone in a config not transformers': a layer without it is wrong only where no layer has it
    return found + [(call, finding) for call, kind, finding in missing if not (kind[2] and finding.source in windowed)]


def _same(cu_q: np.ndarray, cu_k: np.ndarray) -> np.ndarray:
    """Bool (Lq, Lk): the query and the key are of the same packed sequence."""
    seq_q = np.repeat(np.arange(len(cu_q) - 1), np.diff(cu_q))
    seq_k = np.repeat(np.arange(len(cu_k) - 1), np.diff(cu_k))
    return seq_q[:, None] == seq_k[None, :]


RULES = (
    Rule("window-misplaced", "wrong", "steps", "a sliding layer over packed sequences (cu_seqlens_q/k) whose mask sees "
         "keys behind the stated window and keys after the query: the band on the wrong side", windows),
)
