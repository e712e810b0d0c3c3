"""Why one cell of a mask is kept or masked: the expression's tree evaluated at (b, q, kv), each kind in its own words.

    explain(mask, b=0, q=400, kv=300)  ->  Why(keep=False, tree=Node("&", ...))

Each kind answers for one cell with plain integers (Kind.why), so a cell of a 1M-token mask is explained without
its intervals or cells; `&`, `|` and `~` say which of their parts decided. A tensor (--mask, a traced call) has no
expression: its cell is read, and the answer says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from maskcli import expression as ex
from maskcli import terms
from maskcli.errors import MaskError
from maskcli.mask import Mask
from maskcli.text import shortened

MAX_ROWS = 8  # batch rows explained for a Q,KV without B; B,Q,KV picks any one
OPS = {ex.And: "&", ex.Or: "|", ex.Not: "~"}


@dataclass(frozen=True)
class Node:
    """One node of the tree at the cell: a kind (op None) with its reason, or &, |, ~ with how its parts decided."""

    text: str  # canonical text of the kind or sub-expression
    keep: bool
    reason: str
    op: str | None = None
    children: tuple = ()
    kind: str | None = None

    def json(self) -> dict:
        data = {"text": self.text, "keep": self.keep, "reason": self.reason}
        if self.op is None:
            return {"kind": self.kind, **data}
        return {"op": self.op, **data, "items": [child.json() for child in self.children]}


@dataclass(frozen=True)
class Why:
    """The answer for one cell: its verdict, the tree (None for a tensor), and what the cell is."""

    b: int
    q: int
    kv: int
    keep: bool
    tree: Node | None
    q_idx: int  # the local indices a kernel and a mask_mod see
    kv_idx: int
    note: str = ""  # a tensor's: where its cell was read, and why there is no tree
    heads: tuple[bool, ...] = ()  # a tensor whose heads differ: the cell of each head

    def json(self) -> dict:
        data = {"batch": self.b, "q": self.q, "kv": self.kv, "q_idx": self.q_idx, "kv_idx": self.kv_idx, "keep": self.keep}
        if self.heads:
            data["heads"] = list(self.heads)
        return {**data, "tree": self.tree.json() if self.tree is not None else None, **({"note": self.note} if self.note else {})}


def parse_cell(text: str, mask: Mask, flag: str = "--why") -> list[tuple[int, int, int]]:
    """'Q,KV' (every batch row, up to MAX_ROWS) or 'B,Q,KV' -> [(b, q, kv)], absolute positions, checked against the mask."""
    f = mask.frame
    valid = f"give Q,KV (absolute positions, queries {f.q_start}-{f.q_end - 1}, keys {f.k_start}-{f.k_end - 1})"
    if mask.batch > 1:
        valid += f" or B,Q,KV (batch rows 0-{mask.batch - 1})"
    match = re.fullmatch(r"\s*(?:([+-]?[0-9]+)\s*,)?\s*([+-]?[0-9]+)\s*,\s*([+-]?[0-9]+)\s*", text)
    if match is None:
        raise MaskError(f"{flag} {shortened(text, 40)!r} is not a cell: {valid}, like {f.q_end - 1},{f.k_start}")
    longest = max(len(group.lstrip("+-")) for group in match.groups() if group is not None)
    if longest > 19:  # int() refuses past 4,300 digits; past 19 none is a position of any mask
        raise MaskError(f"{flag} {shortened(text, 40)!r}: a number of {longest:,} digits is outside this mask: {valid}")
    b_text, q, kv = match.group(1), int(match.group(2)), int(match.group(3))
    for value, low, high, what in ((q, f.q_start, f.q_end, "queries"), (kv, f.k_start, f.k_end, "keys")):
        if not low <= value < high:
            region = " (the region --rows/--keys view)" if mask.whole is not None else ""
            raise MaskError(f"{flag} {text.strip()}: {value} is outside the {what} {low}-{high - 1} of this mask{region}: {valid}")
    if b_text is None:
        return [(b, q, kv) for b in range(min(mask.batch, MAX_ROWS))]
    b = int(b_text)
    if not 0 <= b < mask.batch:
        raise MaskError(f"{flag} {text.strip()}: batch row {b} is outside the mask's batch rows 0-{mask.batch - 1}: {valid}")
    return [(b, q, kv)]


def explain(mask: Mask, b: int, q: int, kv: int) -> Why:
    """The cell (batch row b, absolute q, kv) of `mask`, and why."""
    q_idx, kv_idx = q - mask.frame.q_start, kv - mask.frame.k_start
    if mask.tree is None:
        keep = mask.keep[b if mask.keep.shape[0] > 1 else 0, :, q_idx, kv_idx]
        heads = tuple(bool(v) for v in keep) if len(set(keep.tolist())) > 1 else ()
        return Why(b, q, kv, bool(keep[0]), None, q_idx, kv_idx, tensor_note(mask), heads)
    node = _node(mask.tree, mask.whole or mask.frame, b, q, kv)
    return Why(b, q, kv, node.keep, node, q_idx, kv_idx)


def tensor_note(mask: Mask) -> str:
    """What --why says of a tensor's cell: there is no tree to explain it."""
    return (f"the cell of {mask.text}, read as it is: a tensor has no expression, so there is no tree of kinds "
            "to explain it (maskcli inspect names the kinds that make such a tensor)")


def _node(tree, frame, b: int, q: int, kv: int) -> Node:
    if isinstance(tree, (ex.And, ex.Or, ex.Not)):
        items = tree.items if not isinstance(tree, ex.Not) else (tree.item,)
        children = tuple(_node(item, frame, b, q, kv) for item in items)
        keep, reason = _combined(tree, children)
        return Node(terms.text(tree), keep, reason, OPS[type(tree)], children)
    kind = tree.kind
    if kind.why is not None:
        keep, reason = kind.why(tree.values, frame, b, q, kv)
    else:  # a user's mask_mod: asked at the one cell, head 0 (torch)
        keep = _asked(tree, frame, b, q, kv)
        reason = f"your mask_mod {kind.name}(b={b}, h=0, q_idx={q - frame.q_start}, kv_idx={kv - frame.k_start}) returned {keep}"
    return Node(tree.text(), bool(keep), reason, kind=kind.name)


def _asked(term, frame, b: int, q: int, kv: int) -> bool:
    import torch

    index = [torch.tensor([value], dtype=torch.int64).view(*(1 if i != axis else -1 for i in range(4))) for axis, value in enumerate((b, 0, q, kv))]
    return bool(term.kind.predicate(term.values, frame, "cpu")(*index).reshape(-1)[0])


def _names(children, keep: bool) -> str:
    named = [shortened(child.text, 40) for child in children if child.keep == keep]
    return ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")


def _combined(tree, children) -> tuple[bool, str]:
    if isinstance(tree, ex.Not):
        inner = children[0]
        return (not inner.keep), f"{shortened(inner.text, 40)} {'keeps' if inner.keep else 'masks'} it, and ~ flips that"
    if isinstance(tree, ex.And):
        if all(child.keep for child in children):
            return True, f"all {len(children)} parts keep it"
        masking = [child for child in children if not child.keep]
        return False, f"{_names(children, False)} mask{'s' if len(masking) == 1 else ''} it"
    if any(child.keep for child in children):
        keeping = [child for child in children if child.keep]
        return True, f"{_names(children, True)} keep{'s' if len(keeping) == 1 else ''} it"
    return False, f"none of its {len(children)} parts keeps it"
