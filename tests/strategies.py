"""Hypothesis strategies for random masks: positions, kinds with parameters, trees, padding, batch rows.

Each case is (tree for tests/definitions.py, MaskOptions fields, the frame the issue's rules give, valid keys per batch row).
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

import definitions as ref


@st.composite
def positions(draw):
    """Options that place the queries and keys, and the frame the issue's rules give for them."""
    lq = draw(st.integers(1, 6))
    offset = draw(st.one_of(st.none(), st.integers(0, 5)))
    kv_len = draw(st.one_of(st.none(), st.integers(1, 9)))
    kv_start = draw(st.one_of(st.none(), st.integers(0, 4)))
    align = draw(st.sampled_from([None, "top-left", "bottom-right"])) if kv_len is not None and offset is None else None
    k0 = kv_start or 0
    if kv_len is None:
        q0 = offset or 0
        k1 = q0 + lq
    else:
        k1 = k0 + kv_len
        q0 = offset if offset is not None else (k1 - lq if align == "bottom-right" else k0)
    if k1 <= k0 or q0 < 0:
        kv_start, k0, align = None, 0, None
        q0 = offset or 0
        kv_len = None
        k1 = q0 + lq
    options = dict(length=lq, offset=offset, kv_start=kv_start, kv_len=kv_len, align=align)
    return options, (q0, lq, k0, k1 - k0)


def labels(n, rows, low, high):
    return st.lists(st.lists(st.integers(low, high), min_size=n, max_size=n), min_size=rows, max_size=rows)


@st.composite
def leaves(draw, n, lq, batch, padded):
    names = ["full", "causal", "window", "lookback", "band", "prefix", "sink", "local", "tril", "triu", "chunk", "document", "segment", "blocks", "tree"]
    if padded:
        names.append("padding")
    name = draw(st.sampled_from(names))
    rows = draw(st.sampled_from([1, batch]))
    if name in ("full", "causal", "padding"):
        return ("kind", name, {})
    if name in ("window", "lookback", "band"):
        return ("kind", name, {"window": draw(st.integers(1, 5))})
    if name in ("prefix", "sink"):
        return ("kind", name, {name: draw(st.integers(1, n))})
    if name == "local":
        if draw(st.booleans()):  # chunks that start again at each document
            return ("kind", name, {"chunk_size": draw(st.integers(1, 4)), "documents": draw(labels(n, rows, 0, 2))})
        return ("kind", name, {"chunk_size": draw(st.integers(1, 4))})
    if name in ("tril", "triu"):
        return ("kind", name, {"diagonal": draw(st.integers(-3, 3)), "means": draw(st.sampled_from(["keep", "block"]))})
    if name == "chunk" and draw(st.booleans()):  # non-decreasing labels: one interval per row
        return ("kind", name, {"labels": [sorted(row) for row in draw(labels(n, rows, 0, 3))]})
    if name in ("chunk", "document", "segment"):
        return ("kind", name, {"labels": draw(labels(n, rows, 0, 2))})
    if name == "blocks":
        return ("kind", name, {"labels": draw(labels(n, rows, -1, 2))})
    parents = [draw(st.integers(-1, i - 1)) for i in range(lq)]
    return ("kind", "tree", {"parents": parents})


@st.composite
def cases(draw):
    options, frame = draw(positions())
    q0, lq, k0, lk = frame
    n = max(q0 + lq, k0 + lk)
    batch = draw(st.integers(1, 2))
    padding = draw(st.sampled_from(["none", "lengths", "ids"]))
    pad_rows = draw(st.sampled_from([1, batch]))  # one --ids/--lengths row may serve every label row
    valid = None
    if padding == "lengths":
        lengths = draw(st.lists(st.integers(0, n), min_size=pad_rows, max_size=pad_rows))
        options["lengths"] = ",".join(map(str, lengths))
        valid = [[kv < length for kv in range(n)] for length in lengths]
    elif padding == "ids":
        ids = draw(st.lists(st.lists(st.sampled_from([0, 7, 8]), min_size=n, max_size=n), min_size=pad_rows, max_size=pad_rows))
        options["ids"] = ";".join(",".join(map(str, row)) for row in ids)
        valid = [[token != 0 for token in row] for row in ids]
    else:
        batch = draw(st.sampled_from([1, batch]))  # labels alone may set the batch
    tree = draw(st.recursive(
        leaves(n, lq, batch, valid is not None),
        lambda inner: st.one_of(
            inner.map(lambda t: ("not", t)),
            st.lists(inner, min_size=2, max_size=3).map(lambda ts: ("and", ts)),
            st.lists(inner, min_size=2, max_size=3).map(lambda ts: ("or", ts)),
        ),
        max_leaves=4,
    ))
    # a local(C) left to take the document labels finds one set: two make maskcli ask which (tested on their own)
    wanting = any(leaf[1] == "local" and "documents" not in leaf[2] for leaf in ref.leaves(tree))
    assume(not wanting or len(ref.document_labels(tree)) <= 1)
    return tree, options, frame, valid


def uses_ids(options):
    return options.get("ids") is not None


def expected_cells(tree, options, frame, valid, batch):
    """The reference cells [B][Lq][Lk] for a case."""
    left = [ref.left_padding(row) for row in valid] if uses_ids(options) else [0] * batch
    q0, lq, k0, lk = frame
    return np.array(ref.dense(tree, q0=q0, lq=lq, k0=k0, lk=lk, batch=batch, valid=valid, ids_valid_left_pad=left))
