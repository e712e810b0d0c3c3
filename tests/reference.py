"""Independent reference masks: the definitions of issue 2 as plain Python double loops.

Nothing here imports maskcli. Query positions are absolute (`offset + local row`);
True / 1 = this query may attend to this key.
"""

from __future__ import annotations

KINDS = ("causal", "tril", "triu", "padding", "prefill", "chunk", "window", "prefix", "document")
CONVENTIONS = ("keep", "block", "additive", "min", "int")


def rule(kind, *, diagonal=None, means=None, window=None, prefix=None, labels=None):
    """keep(q, kv) for one kind, q and kv absolute positions, straight from the definitions."""
    if kind in ("causal", "prefill"):
        return lambda q, kv: kv <= q
    if kind == "tril":
        diagonal = 0 if diagonal is None else diagonal
        ones = lambda q, kv: kv - q <= diagonal  # noqa: E731 - the 1-cells of torch.tril(ones, D)
        return ones if (means or "keep") == "keep" else (lambda q, kv: not ones(q, kv))
    if kind == "triu":
        diagonal = 1 if diagonal is None else diagonal
        ones = lambda q, kv: kv - q >= diagonal  # noqa: E731 - the 1-cells of torch.triu(ones, D)
        return ones if means == "keep" else (lambda q, kv: not ones(q, kv))
    if kind == "padding":
        return lambda q, kv: True
    if kind == "chunk":
        return lambda q, kv: labels[kv] <= labels[q]
    if kind == "window":
        return lambda q, kv: kv <= q and q - kv < window
    if kind == "prefix":
        return lambda q, kv: kv <= q or kv < prefix
    if kind == "document":
        return lambda q, kv: labels[kv] == labels[q] and kv <= q
    raise ValueError(kind)


def valid_from_lengths(lengths, k_len):
    return [[kv < length for kv in range(k_len)] for length in lengths]


def valid_from_ids(ids, pad_id):
    return [[token != pad_id for token in row] for row in ids]


def reference(kind, q_len, k_len, offset=0, *, valid=None, heads=1, **params):
    """Nested lists [B][H][Lq][Lk] of bool by a double loop over the definition (and key padding)."""
    keep = rule(kind, **params)
    batch = 1 if valid is None else len(valid)
    out = []
    for b in range(batch):
        plane = [
            [bool(keep(offset + i, kv)) and (valid is None or bool(valid[b][kv])) for kv in range(k_len)]
            for i in range(q_len)
        ]
        out.append([plane for _ in range(heads)])
    return out


def as_ints(nested):
    """Bools to 0/1, at any depth."""
    if isinstance(nested, list):
        return [as_ints(item) for item in nested]
    return int(nested)


def expected_params(kind, *, q_len, offset=0, diagonal=None, means=None, window=None, prefix=None,
                    labels=None, lengths=None, ids=None, pad_id=0, heads=1):
    """The `params` object the issue asks --json to carry, written out per kind."""
    params = {}
    if kind in ("chunk", "document"):
        params["chunks"] = list(labels)
    else:
        params["len"] = q_len
    if kind == "prefill":
        params["offset"] = offset
    if kind in ("tril", "triu"):
        params["diagonal"] = {"tril": 0, "triu": 1}[kind] if diagonal is None else diagonal
        params["means"] = means or {"tril": "keep", "triu": "block"}[kind]
    if kind == "window":
        params["window"] = window
    if kind == "prefix":
        params["prefix"] = prefix
    if lengths is not None:
        params["lengths"] = list(lengths)
    if ids is not None:
        params["ids"] = [list(row) for row in ids]
        params["pad_id"] = pad_id
    if heads != 1:
        params["heads"] = heads
    return params
