"""Independent reference for mask kinds and expressions: the definitions as plain Python double loops.

Nothing here imports maskcli. Positions are absolute: queries q0..q0+Lq-1, keys k0..k0+Lk-1;
labels, ids and token ids cover positions 0..n-1. True = this query may attend to this key.

A tree is ("kind", name, params), ("and", [trees]), ("or", [trees]) or ("not", tree);
params use plain values (labels as a list of rows).
"""

from __future__ import annotations


def _row(rows, b):
    return rows[b] if len(rows) > 1 else rows[0]


def ancestors_or_self(parents, i):
    line = set()
    while i >= 0:
        line.add(i)
        i = parents[i]
    return line


def kind_keeps(name, p, b, q, kv, ctx) -> bool:
    """keep(q, kv) of one kind, straight from its definition."""
    if name == "full":
        return True
    if name == "causal":
        return kv <= q
    if name in ("tril", "triu"):
        d = p.get("diagonal", 0 if name == "tril" else 1)
        ones = (kv - q <= d) if name == "tril" else (kv - q >= d)
        means = p.get("means", "keep" if name == "tril" else "block")
        return ones if means == "keep" else not ones
    if name == "window":
        return q - p["window"] < kv <= q
    if name == "prefix":
        return kv <= q or kv < p["prefix"]
    if name == "sink":
        return kv < p["sink"]
    if name == "lookback":
        return kv > q - p["window"]  # Hugging Face's sliding_window_overlay: no kv <= q
    if name == "band":
        return abs(q - kv) < p["window"]
    if name == "local":
        pad = _row(ctx["left_pad"], b)
        if p.get("documents") is None:
            return (q - pad) // p["chunk_size"] == (kv - pad) // p["chunk_size"] and kv <= q
        # packed documents: positions restart at 0 in each run of equal labels (Hugging Face's position_ids),
        # counted from the first real token where the row is left-padded; chunk = position // C in one document
        labels = _row(p["documents"], b)

        def chunk(i):
            start = max(pad, max(j for j in range(i + 1) if j == 0 or labels[j] != labels[j - 1]))
            return start, (i - start) // p["chunk_size"]

        return chunk(q) == chunk(kv) and kv <= q
    if name in ("chunk", "document", "segment", "blocks"):
        labels = _row(p["labels"], b)
        if name == "chunk":
            return labels[kv] <= labels[q]
        if name == "document":
            return labels[kv] == labels[q] and kv <= q
        if name == "segment":
            return labels[kv] == labels[q]
        return labels[q] == labels[kv] and labels[q] >= 0
    if name == "tree":
        q0 = ctx["q0"]
        return kv < q0 or (kv - q0) in ancestors_or_self(p["parents"], q - q0)
    if name == "padding":
        return _row(ctx["valid"], b)[kv]
    raise ValueError(name)


def keeps(tree, b, q, kv, ctx) -> bool:
    op = tree[0]
    if op == "and":
        return all(keeps(t, b, q, kv, ctx) for t in tree[1])
    if op == "or":
        return any(keeps(t, b, q, kv, ctx) for t in tree[1])
    if op == "not":
        return not keeps(tree[1], b, q, kv, ctx)
    return kind_keeps(tree[1], tree[2], b, q, kv, ctx)


def leaves(tree):
    if tree[0] in ("and", "or"):
        return [leaf for t in tree[1] for leaf in leaves(t)]
    if tree[0] == "not":
        return leaves(tree[1])
    return [tree]


def document_labels(tree) -> list:
    """The distinct label sets of the document and segment kinds of a tree."""
    found = []
    for _, name, p in leaves(tree):
        if name in ("document", "segment") and p["labels"] not in found:
            found.append(p["labels"])
    return found


def with_documents(tree):
    """local without documents takes the tree's document (or segment) labels, where it has exactly one set."""
    found = document_labels(tree)
    if len(found) != 1:
        return tree

    def give(t):
        if t[0] in ("and", "or"):
            return (t[0], [give(item) for item in t[1]])
        if t[0] == "not":
            return ("not", give(t[1]))
        if t[1] == "local" and t[2].get("documents") is None:
            return ("kind", "local", {**t[2], "documents": found[0]})
        return t

    return give(tree)


def dense(tree, *, q0, lq, k0, lk, batch=1, valid=None, ids_valid_left_pad=None):
    """Nested lists [B][Lq][Lk] of bool by a double loop (and key padding, when `valid` is given)."""
    tree = with_documents(tree)
    left_pad = ids_valid_left_pad if ids_valid_left_pad is not None else [0] * batch
    ctx = {"q0": q0, "valid": valid, "left_pad": left_pad}
    return [
        [
            [keeps(tree, b, q, kv, ctx) and (valid is None or bool(_row(valid, b)[kv])) for kv in range(k0, k0 + lk)]
            for q in range(q0, q0 + lq)
        ]
        for b in range(batch)
    ]


def left_padding(valid_row) -> int:
    """Pad positions before the first real token, as Hugging Face counts them."""
    count = 0
    for v in valid_row:
        if v:
            break
        count += 1
    return count


def text(tree) -> str:
    """The expression as maskcli spells it (for building the same mask through maskcli)."""
    op = tree[0]
    if op == "and":
        return " & ".join(f"({text(t)})" for t in tree[1])
    if op == "or":
        return " | ".join(f"({text(t)})" for t in tree[1])
    if op == "not":
        return f"~({text(tree[1])})"
    name, p = tree[1], tree[2]
    if not p:
        return name
    parts = []
    for key, value in p.items():
        if key in ("labels", "parents"):
            parts.insert(0, ";".join(",".join(map(str, row)) for row in (value if key == "labels" else [value])))
        elif key == "documents":
            parts.append("documents=[" + ";".join(",".join(map(str, row)) for row in value) + "]")
        elif key in ("window", "prefix", "sink", "chunk_size", "diagonal"):
            parts.insert(0, str(value))
        else:
            parts.append(f"{key}={value}")
    return f"{name}({', '.join(parts)})"
