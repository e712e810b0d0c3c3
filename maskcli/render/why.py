"""--why in words and as JSON: the tree of an expression evaluated at one cell, each kind with its own reason."""

from __future__ import annotations

import json

from maskcli.mask import Mask
from maskcli.text import shortened
from maskcli.why import Node, Why


def verdict(keep: bool) -> str:
    return "kept" if keep else "masked"


def where_text(mask: Mask, why: Why) -> str:
    """'query 400, key 300, batch row 1': the cell in absolute positions, and its local indices where they differ."""
    text = f"query {why.q}, key {why.kv}" + (f", batch row {why.b}" if mask.batch > 1 else "")
    if (why.q_idx, why.kv_idx) != (why.q, why.kv):
        text += f" (q_idx {why.q_idx}, kv_idx {why.kv_idx} in the tensor)"
    return text


def positions_text(mask: Mask) -> str:
    """Where the queries and keys sit, with the padding and the region, in one line."""
    f = mask.whole or mask.frame
    parts = [f.describe()]
    if f.q_start:
        parts.append(f"{f.q_start} tokens before the queries (--offset)")
    if f.k_start:
        parts.append(f"keys from {f.k_start} (--kv-start)")
    if mask.padding_text:
        parts.append(shortened(mask.padding_text, 80))
    if mask.whole is not None:
        parts.append(f"viewed over {mask.frame.describe()}")
    return "positions: " + " · ".join(parts)


def _lines(node: Node, lead: str = "", last: bool = True, top: bool = True) -> list[str]:
    branch = "" if top else ("└─ " if last else "├─ ")
    if node.op is None:
        line = f"{lead}{branch}{shortened(node.text, 60)}: {node.reason} -> {verdict(node.keep)}"
    else:  # the whole expression heads the answer: its root is named by its operator only
        line = f"{lead}{branch}{node.op if top else shortened(node.text, 60)} -> {verdict(node.keep)}: {node.reason}"
    out = [line]
    inner = lead + ("" if top else ("   " if last else "│  "))
    for i, child in enumerate(node.children):
        out += _lines(child, inner, i == len(node.children) - 1, top=False)
    return out


def why_text(mask: Mask, answers: list[Why], label: str = "", positions: bool = True) -> str:
    """The answers for one mask, in words: the cell and its verdict, the tree, then where the positions sit."""
    out = []
    for why in answers:
        heads = ""
        if why.heads:  # a tensor whose heads differ at this cell
            listed = ", ".join(f"{h} {verdict(keep)}" for h, keep in enumerate(why.heads[:16])) + (", ..." if len(why.heads) > 16 else "")
            heads = f" in head 0 (heads: {listed})"
        out.append(f"{label}{where_text(mask, why)} of {shortened(mask.text, 80)}: {verdict(why.keep)}{heads}")
        out += _lines(why.tree, "  ") if why.tree is not None else [f"  {why.note}"]
    if positions:
        out.append(positions_text(mask))
    return "\n".join(out)


def diff_why_text(a: Mask, b: Mask, answers_a: list[Why], answers_b: list[Why]) -> str:
    """A cell in A and in B: whether it differs, then each side's tree, then the positions (each side's where they differ)."""
    out = []
    for why_a, why_b in zip(answers_a, answers_b):
        cell = where_text(a, why_a)
        if why_a.keep == why_b.keep:
            out.append(f"the cell {cell} is the same in A and B: {verdict(why_a.keep)}")
        else:
            out.append(f"the cell {cell} differs: A {'keeps' if why_a.keep else 'masks'} it, B {'keeps' if why_b.keep else 'masks'} it")
    out.append(why_text(a, answers_a, "A: ", positions=False))
    out.append(why_text(b, answers_b, "B: ", positions=False))
    where_a, where_b = positions_text(a), positions_text(b)
    out += [where_a] if where_a == where_b else [f"A {where_a}", f"B {where_b}"]
    return "\n".join(out)


def diff_why_dumps(a: Mask, b: Mask, answers_a: list[Why], answers_b: list[Why]) -> str:
    same = all(x.keep == y.keep for x, y in zip(answers_a, answers_b))
    return json.dumps({"same": same, "A": why_json(a, answers_a), "B": why_json(b, answers_b)})


def why_json(mask: Mask, answers: list[Why]) -> dict:
    return {**mask.json(), "why": [why.json() for why in answers]}


def why_dumps(mask: Mask, answers: list[Why]) -> str:
    return json.dumps(why_json(mask, answers))
