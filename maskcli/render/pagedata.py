"""What an HTML page embeds about a mask: its key intervals as runs of affine rows, its structure, and the data
its script needs to explain any cell (the expression tree with each kind's parameters, the positions, the padding).

Rows are stored as runs: a run of rows a..a'-1 has, per interval slot k, start(q) = s0 + ds*(q-a) and
end(q) = e0 + de*(q-a), so a causal, window or document mask of 1M rows is a handful of runs (the rows of a
window advance by 1). Arrays go in as base64 little-endian int32 (float64 where a value passes 2^31), which the
page reads into typed arrays. Everything is numpy over rows: no Python loop per token.
"""

from __future__ import annotations

import base64

import numpy as np

from maskcli import expression as ex
from maskcli import terms
from maskcli.errors import MaskError
from maskcli.intervals import Intervals
from maskcli.kinds.base import Labels
from maskcli.mask import Mask
from maskcli.render.structure import structure
from maskcli.render.why import positions_text
from maskcli.text import shortened
from maskcli.why import tensor_note

BUDGET = 3_000_000  # numbers of interval runs embedded per page (about 16 MB of base64 int32): past it, rows are sampled
MAX_BATCH = 8  # batch rows a page embeds (a selector picks one)
MAX_DENSE = 1 << 24  # cells read from a tensor or a mask_mod, where the mask has no few intervals
MAX_TOKENS = 4096  # words shown on hover up to this many positions


def packed(values) -> dict:
    """A base64 typed array for the page: int32 where every value fits, else float64 (exact to 2^53)."""
    array = np.ascontiguousarray(np.asarray(values).reshape(-1))
    if array.size == 0 or (array.min() >= -(2**31) and array.max() < 2**31):
        return {"t": "i4", "b": base64.b64encode(array.astype("<i4").tobytes()).decode()}
    return {"t": "f8", "b": base64.b64encode(array.astype("<f8").tobytes()).decode()}


def row_runs(starts: np.ndarray, ends: np.ndarray) -> dict:
    """Runs of affine rows of one batch row's (Lq, K) intervals: where each run starts, its first row and its steps."""
    rows, k = starts.shape
    if rows == 1:
        first = np.zeros(1, dtype=np.int64)
        steps = np.zeros((1, 2 * k), dtype=np.int64)
    else:
        steps_all = np.concatenate([np.diff(starts, axis=0), np.diff(ends, axis=0)], axis=1)  # (L-1, 2K)
        change = np.any(steps_all[1:] != steps_all[:-1], axis=1)
        first = np.concatenate([[0], np.flatnonzero(change) + 1]).astype(np.int64)
        steps = steps_all[first]
    return {"n": int(first.size), "k": k, "a": packed(first), "s": packed(starts[first]), "e": packed(ends[first]),
            "ds": packed(steps[:, :k]), "de": packed(steps[:, k:])}


def dense_intervals(cells: np.ndarray, k_start: int, k_end: int) -> Intervals:
    """Intervals of a dense bool (Lq, Lk) array (a tensor's cells), found from the edges of its runs, vectorised."""
    rows = cells.shape[0]
    edges = np.diff(np.pad(cells.astype(np.int8), ((0, 0), (1, 1))), axis=1)
    r_up, c_up = np.nonzero(edges == 1)
    _, c_down = np.nonzero(edges == -1)
    per_row = np.bincount(r_up, minlength=rows)
    width = max(1, int(per_row.max()) if rows else 1)
    slot = np.arange(r_up.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    starts = np.full((1, rows, width), k_end, dtype=np.int64)
    ends = np.full((1, rows, width), k_end, dtype=np.int64)
    starts[0, r_up, slot] = c_up + k_start
    ends[0, r_up, slot] = c_down + k_start
    return Intervals(starts, ends, k_start, k_end)


def mask_rows(mask: Mask, b: int) -> tuple[dict, str]:
    """Batch row b of the mask as row runs, and how they were found (intervals, or cells where they are not few)."""
    f = mask.frame
    if mask.exact:
        found = mask.intervals()
        how = "key intervals"
    else:
        if f.q_len * f.k_len > MAX_DENSE:
            raise MaskError(f"--html: {shortened(mask.text, 60)!r} has no few key intervals ({mask.why_not_exact}) and its "
                            f"{f.q_len:,} x {f.k_len:,} cells are too many to read into a page: use --rows/--keys for a region")
        found = dense_intervals(np.asarray(mask.cells(b)), f.k_start, f.k_end)
        b = 0
        how = "cells"
    starts = found.starts[b if found.starts.shape[0] > 1 else 0]
    ends = found.ends[b if found.ends.shape[0] > 1 else 0]
    return {"stride": 1, **row_runs(starts, ends)}, how


def _numbers(rows: list[dict]) -> int:
    return sum(run["n"] * (1 + 4 * run["k"]) for run in rows)


def sampled(rows: list[dict], mask: Mask, b_rows: list[int], budget: int) -> list[dict]:
    """Where the runs pass the budget, every s-th query row instead (the page says at what zoom exactness stops)."""
    total = _numbers(rows)
    if total <= budget:
        return rows
    stride = -(-total // budget)
    found = mask.intervals()
    out = []
    for b in b_rows:
        starts = found.starts[b if found.starts.shape[0] > 1 else 0][::stride]
        ends = found.ends[b if found.ends.shape[0] > 1 else 0][::stride]
        out.append({"stride": stride, **row_runs(starts, ends)})
    return out


def label_runs(array: np.ndarray) -> list[dict]:
    """Each row of an (R, n) label table as runs: where each run starts and its label (looked up by binary search)."""
    out = []
    for row in array:
        first = np.concatenate([[0], np.flatnonzero(row[1:] != row[:-1]) + 1]) if row.size else np.zeros(0, np.int64)
        out.append({"at": packed(first), "v": packed(row[first]) if row.size else packed([])})
    return out


def _value(value):
    if isinstance(value, Labels):
        return {"runs": label_runs(value.array), "length": value.length}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def why_tree(node):
    """The expression tree for the page's explainer: texts as --why prints them (shortened to 40 and 60), each kind's
    parameters; None where a kind has no explainer in the page (a mask_mod, whose reasons come from running it)."""
    if isinstance(node, (ex.And, ex.Or, ex.Not)):
        items = node.items if not isinstance(node, ex.Not) else (node.item,)
        children = [why_tree(item) for item in items]
        if any(child is None for child in children):
            return None
        text = terms.text(node)
        op = {ex.And: "&", ex.Or: "|", ex.Not: "~"}[type(node)]
        return {"op": op, "t40": shortened(text, 40), "t60": shortened(text, 60), "items": children}
    if node.kind.why is None or node.kind.name not in EXPLAINED:
        return None
    text = node.text()
    return {"kind": node.kind.name, "t40": shortened(text, 40), "t60": shortened(text, 60),
            "p": {name: _value(value) for name, value in node.values.items()}}


EXPLAINED = {"full", "causal", "window", "prefix", "sink", "local", "lookback", "band", "chunk", "document", "segment", "blocks",
             "tril", "triu", "tree", "padding"}  # the kinds page.js explains, each as its kind's why does


def frame_data(mask: Mask) -> dict:
    """The positions the kinds were built on, and the view's, with the key padding (for the explainer and the marks)."""
    whole, view = mask.whole or mask.frame, mask.frame
    data = {"q0": whole.q_start, "k0": whole.k_start, "n": whole.n, "batch": mask.batch,
            "vq0": view.q_start, "vk0": view.k_start, "lq": view.q_len, "lk": view.k_len,
            "lengths": list(whole.lengths) if whole.lengths is not None else None, "padSide": whole.pad_side,
            "padId": whole.pad_id, "ids": None, "valid": None}
    if whole.key_valid is not None:
        data["valid"] = label_runs(whole.key_valid.astype(np.int64))
    if whole.ids is not None:
        data["ids"] = label_runs(whole.ids)
    return data


def structure_data(mask: Mask, b: int) -> dict:
    s = structure(mask, b)
    return {"word": s.word, "segments": [list(x) for x in s.segments], "padKeys": [list(x) for x in s.pad_keys],
            "padQueries": [list(x) for x in s.pad_queries], "cache": s.cache_edge if s.cached else None}


def hover_labels(mask: Mask, tree) -> dict | None:
    """The labels hover names at q and kv: those of the first labelled kind (document, chunk, ...). Where the
    explainer's tree holds them, the page reads them there (leaf i, parameter p), so they are embedded once."""
    from maskcli.render.structure import LABELLED

    if mask.tree is None:
        return None
    for i, term in enumerate(terms.terms(mask.tree)):
        for name, value in term.values.items():
            if isinstance(value, Labels) and term.kind.name in (*LABELLED, "local"):
                word = LABELLED.get(term.kind.name, "doc")
                return {"word": word, "leaf": i, "param": name} if tree is not None else {"word": word, "runs": label_runs(value.array)}
    return None


def label_numbers(mask: Mask) -> int:
    """Numbers the labels, ids and padding take as runs in the page: two for each run of equal values."""
    arrays = [value.array for term in terms.terms(mask.tree) for value in term.values.values()
              if isinstance(value, Labels)] if mask.tree is not None else []
    whole = mask.whole or mask.frame
    arrays += [array for array in (whole.key_valid, whole.ids) if array is not None]
    return sum(2 * (a.shape[0] + int(np.count_nonzero(a[:, 1:] != a[:, :-1]))) for a in arrays)


def unexplained(mask: Mask, tree) -> str | None:
    """Why the page cannot give --why's answer for this mask, or None where it can (its text then agrees with --why)."""
    if mask.tree is not None and tree is None:
        return ("this mask calls your mask_mod, which the page cannot run: "
                "maskcli show ... --why Q,KV (with the same --mask-mod) explains the cell")
    if mask.tree is None and mask.keep.shape[1] > 1:
        return ("this tensor's heads differ and the page draws head 0: "
                "maskcli show --mask FILE --why Q,KV gives the cell of every head")
    return None


def mask_data(mask: Mask) -> dict:
    """Everything one mask contributes to a page: rows per batch row, structure, explainer and hover data."""
    b_rows = list(range(min(mask.batch, MAX_BATCH)))
    found = [mask_rows(mask, b) for b in b_rows]
    rows = [run for run, _ in found]
    labels = label_numbers(mask)
    if labels > BUDGET // 2:
        raise MaskError(f"--html: the labels, ids and padding of {shortened(mask.text, 60)!r} make {labels // 2:,} runs of equal "
                        f"values, past the {BUDGET // 4:,} a page holds: view a region with --rows/--keys")
    if mask.exact:
        rows = sampled(rows, mask, b_rows, BUDGET - labels)
    elif _numbers(rows) + labels > BUDGET:  # a tensor's rows cannot be sampled exactly from the expression: refuse, whole
        raise MaskError(f"--html: the cells of {shortened(mask.text, 60)!r} take {_numbers(rows):,} numbers as runs of "
                        f"key intervals, past the {BUDGET:,} a page holds: view a region with --rows/--keys")
    tree = why_tree(mask.tree) if mask.tree is not None else None
    tokens = list(mask.tokens) if mask.tokens is not None and len(mask.tokens) <= MAX_TOKENS else None  # by absolute position
    return {
        "text": mask.text, "text80": shortened(mask.text, 80), "title": mask.title, "frame": frame_data(mask),
        "rows": rows, "how": found[0][1], "structure": [structure_data(mask, b) for b in b_rows],
        "tree": tree, "unexplained": unexplained(mask, tree),
        "note": None if mask.tree is not None else tensor_note(mask),
        "positions": positions_text(mask), "labels": hover_labels(mask, tree), "tokens": tokens,
    }
