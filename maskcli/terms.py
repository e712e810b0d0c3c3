"""Expressions bound to kinds: each call becomes a Term with checked parameters, and a tree of
terms gives its intervals (numpy) and its predicate (torch) by combining its kinds'.

A call written with parentheses carries its own parameters; a bare kind name takes them
from the command-line flags (`window --window 3`), and a flag that no bare kind reads is
refused, so a silently ignored `--window` cannot happen.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from maskcli import expression as ex
from maskcli.errors import MaskError
from maskcli.intervals import Intervals, NotFew
from maskcli.kinds import get as get_kind
from maskcli.kinds import values as label_values
from maskcli.kinds.base import REQUIRED, Kind, Labels, Param
from maskcli.positions import Frame
from maskcli.text import shortened


@dataclass(frozen=True)
class Term:
    """One kind with its parameters, checked."""

    kind: Kind
    params: tuple[tuple[str, object], ...]
    at: int = field(default=0, compare=False)
    inherited: tuple[str, ...] = field(default=(), compare=False)  # parameters taken from the expression, not written

    @property
    def values(self) -> dict:
        return dict(self.params)

    def text(self) -> str:
        """Canonical text: the first parameter always, the others where they differ from their default."""
        if not self.kind.params:
            return self.kind.name
        values = self.values
        parts = []
        for i, param in enumerate(self.kind.params):
            value = values[param.name]
            if param.name in self.inherited:
                continue  # written once, where the expression gives it; parsing the text again takes it the same way
            if isinstance(value, Labels):
                if i == 0 or value.form == "sizes":
                    parts.append(value.text)  # 0,0,1,1 / "labels.npy" / sizes=[3,5]
                else:
                    parts.append(f"{param.name}={value.text}" if value.form == "file" else f"{param.name}=[{value.text}]")
            elif i == 0:
                parts.append(str(value))
            elif value != param.default:
                parts.append(f"{param.name}={value}")
        return f"{self.kind.name}({', '.join(parts)})"

    def json(self) -> dict:
        out = {}
        for name, value in self.params:
            out[name] = value.as_json() if isinstance(value, Labels) else value
            if isinstance(value, Labels) and value.form == "file":
                out[name + "_file"] = value.text.strip('"')
        return {"kind": self.kind.name, "params": out}


def text(tree) -> str:
    """The canonical text of a tree of terms: the name of the mask."""
    if isinstance(tree, Term):  # one term: no tree to walk
        return tree.text()
    return ex.print_tree(ex.with_leaves(tree, [term.text() for term in ex.leaves(tree)]), leaf=str)  # texts, no callback


def terms(tree) -> list[Term]:
    return [tree] if isinstance(tree, Term) else ex.leaves(tree)


def bound(kind: Kind, values: dict) -> Term:
    """The kind bound to values given by name (read off a tensor, not typed), each checked as a typed one is
    (MaskError where one is refused); a parameter not given takes its default."""
    return bound_each([(kind, values)], refuse=True)[0]


def bound_each(found: list[tuple[Kind, dict]], refuse: bool = False) -> list[Term | None]:
    """`bound` for many (kind, values) at once, None for each one refused (`refuse`: raise its MaskError instead):
    recognition's candidates, bound in one call."""
    terms_: list[Term | None] = []
    for kind, values in found:
        checked = []
        try:
            for p in kind.params:
                checked.append((p.name, p.check(values.get(p.name, p.default), kind.name)))
        except MaskError:
            if refuse:
                raise
            terms_.append(None)
            continue
        terms_.append(Term(kind, tuple(checked)))
    return terms_


# --- binding calls to kinds ------------------------------------------------------------------


def resolve(tree, flags: dict[str, object], source: str, extra: dict[str, Kind] | None = None, before=None,
            after=None) -> tuple[object, list[str]]:
    """Bind every call of a parsed tree to its kind; return the tree of Terms and the flags it read.

    `flags` maps a parameter flag (--window) to what the user gave; `source` is the
    expression as typed, quoted in messages; `extra` holds kinds of the user's own (mask_mods); `before`, `after`:
    terms bound elsewhere, and-ed around the expression's (`joined`).
    """
    used: list[str] = []
    extra = extra or {}
    quoted = repr(shortened(source, 200))  # once: a chain of 10,000 calls is not quoted 10,000 times

    def bind(call: ex.Call) -> Term:
        kind = extra.get(call.name) or get_kind(call.name, where=quoted if source != call.name else None)
        where = shortened(ex.call_text(call), 60)
        values = _from_call(kind, call, where) if call.called else _from_flags(kind, flags, used)
        for param in kind.params:
            value = values[param.name]
            values[param.name] = param.check(value, where if call.called else f"{param.flag} {value}")
        return Term(kind, tuple((p.name, values[p.name]) for p in kind.params), at=call.at)

    return joined(before, ex.with_leaves(tree, [bind(call) for call in ex.leaves(tree)]), after, source=source), used


def joined(*parts, source: str | None):
    """Trees of terms (None: left out) and-ed in order, each documents parameter left out taking the joined tree's
    labels, as in one expression: an expression's terms with those a source bound itself (`resolve`'s before and
    after: a packed batch's documents, a config's layer type). `source`: the typed text, quoted where it is not clear
    which labels (None: the joined terms' text)."""
    given = [part for part in parts if part is not None]
    if not given:
        raise ValueError("joined: no terms")
    tree = given[0] if len(given) == 1 else ex.both(*given)
    return _documents_inherited(tree, source)


def _documents_inherited(tree, source: str | None):
    """Give each documents parameter left out (local's) the expression's document labels, where it has one set.

    So `document(0,0,0,1,1) & local(2)` restarts its chunks at each document, as Hugging Face's packed
    sequences do; two different sets of document labels leave it to the user to say which.
    """
    wanting = [t for t in ex.leaves(tree) if isinstance(t, Term) and any(p.documents and t.values[p.name] is None for p in t.kind.params)]
    if not wanting:
        return tree
    given = [t for t in ex.leaves(tree) if isinstance(t, Term) and t.kind.documents]
    found = list(dict.fromkeys(t.values["labels"] for t in given))
    if not found:
        return tree
    if len(found) > 1:
        named = " and ".join(shortened(t.text(), 40) for t in given[:2])
        first = wanting[0]
        raise MaskError(
            f"{shortened(first.text(), 40)} in {shortened(text(tree) if source is None else source, 80)!r}: the expression has different document labels "
            f"({named}), so which documents restart its chunks is not clear: give them, like "
            f"{first.kind.name}({first.values[first.kind.params[0].name]}, documents=[0,0,1,1])"
        )

    def inherit(term: Term) -> Term:
        names = tuple(p.name for p in term.kind.params if p.documents and term.values[p.name] is None)
        if not names:
            return term
        params = tuple((name, found[0] if name in names else value) for name, value in term.params)
        return Term(term.kind, params, at=term.at, inherited=names)

    return ex.with_leaves(tree, [inherit(term) for term in ex.leaves(tree)])


def _from_call(kind: Kind, call: ex.Call, where: str) -> dict:
    values: dict = {}
    if call.positional is not None:
        if not kind.params:
            raise MaskError(f"{where}: {kind.name} takes no parameters; write it as {kind.name}")
        first = kind.params[0]
        values[first.name] = _convert(first, call.positional, where)
    for name, value in call.keywords:
        param = kind.param(name) or (next((p for p in kind.params if p.sizes), None) if name == "sizes" else None)
        if param is None:
            known = ", ".join(p.name for p in kind.params) or "none"
            raise MaskError(f"{where}: {kind.name} has no parameter {name!r} (its parameters: {known}; maskcli kinds explains them)")
        if param.name in values:
            raise MaskError(f"{where}: {param.name} is given twice")
        values[param.name] = _convert(param, value, where, sizes=name == "sizes")
    for param in kind.params:
        if param.name not in values:
            if param.required:
                raise MaskError(f"{where}: {kind.name} needs {param.metavar}, {param.help}: write it like {kind.example}")
            values[param.name] = param.default
    return values


def _convert(param: Param, value: ex.Value, where: str, sizes: bool = False):
    if param.type == "labels":
        if isinstance(value, ex.Text):
            if not value.quoted:
                raise MaskError(f"{where}: {value.value!r} is neither integers nor a quoted file name: write {param.name} like 0,0,1,1 or \"labels.npy\"")
            labels = label_values.from_file(value.value, where)
            return label_values.from_sizes(labels.array.tolist(), where) if sizes else labels
        if sizes:
            return label_values.from_sizes(value.rows, where)
        return label_values.inline(value.rows, where)
    if param.type == "int":
        if not isinstance(value, ex.Ints) or value.bracketed or len(value.rows) != 1 or len(value.rows[0]) != 1:
            raise MaskError(f"{where}: {param.name} is one whole number ({param.help}), got {ex.value_text(value)}")
        return value.rows[0][0]
    if not isinstance(value, ex.Text):
        raise MaskError(f"{where}: {param.name} is one of {', '.join(param.choices)}, got {ex.value_text(value)}")
    return value.value


def _from_flags(kind: Kind, flags: dict, used: list[str]) -> dict:
    values: dict = {}
    for param in kind.params:
        value = flags.get(param.flag)
        sizes = flags.get("--sizes") if param.sizes else None
        if value is not None and sizes is not None:
            raise MaskError(f"give {param.flag} or --sizes, not both: both say the {param.name} of {kind.name}")
        if sizes is not None:
            values[param.name] = _labels_given(sizes, "--sizes", sizes=True)
            used.append("--sizes")
        elif value is not None:
            values[param.name] = _labels_given(value, param.flag) if param.type == "labels" else _number(value)
            used.append(param.flag)
        elif param.default is not REQUIRED:
            values[param.name] = param.default
        else:
            raise MaskError(
                f"{kind.name} needs {param.flag} {param.metavar} ({param.help}): give {param.flag}, "
                f"or write it in the expression like {kind.example}"
            )
    return values


def _labels_given(value, flag: str, sizes: bool = False):
    """A flag's text (inline or a file), or a Python value given to build(): a list, an array, a tensor."""
    if isinstance(value, str):
        return label_values.from_flag(value, flag, sizes=sizes)
    return label_values.from_python(value, f"{flag.lstrip('-').replace('-', '_')}=", sizes=sizes)


def _number(value):
    """numpy's and torch's integers are whole numbers too (Param.check refuses what is not one)."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    return value


def check_flags_used(tree, flags: dict, used: list[str], source: str | None) -> None:
    """Refuse a parameter flag that no bare kind of the expression reads (`source`: the typed text; None: the terms'
    text, made only to be quoted)."""
    from maskcli.kinds import flags as flag_table

    for flag, value in flags.items():
        if value is None or flag in used:
            continue
        readers = sorted({kind.name for kind, _ in flag_table().get(flag, [])})
        written = [term.text() for term in terms(tree) if term.kind.name in readers]
        shown = f"{flag} {value}"
        if written:
            raise MaskError(f"{shown} does not apply: {written[0]} in the expression gives its own; drop {flag}")
        raise MaskError(f"{shown} does not apply to {text(tree) if source is None else source!r}: it is for {', '.join(readers)}")


# --- what a tree of terms gives ----------------------------------------------------------------


def intervals(tree, frame: Frame) -> Intervals:
    """Per-row key intervals of the whole tree (may raise intervals.NotFew), repeated terms folded first
    (expression.simplified): each pass of a term is over every query row."""
    if isinstance(tree, Term):  # one term: nothing to fold
        return _made(tree.kind.intervals(tree.values, frame), frame)
    return _intervals(folded(tree), frame)


def folded(tree):
    """The tree with repeated terms folded (expression.simplified), where a term repeats: the terms are compared
    here, so simplifying is asked only of a tree that holds a repeat (a tree of distinct terms evaluates as it is)."""
    leaves = ex.leaves(tree)
    return ex.simplified(tree) if len(set(leaves)) < len(leaves) else tree


def placed_each(trees: list, frame: Frame) -> list:
    """Each tree's key intervals at `frame`, as mask.placed makes them with --len given, before the key padding cuts
    them: a MaskError where placed refuses the tree there (its first kind's draft tree is not --len queries, labels
    that do not cover the positions, a kind's own check), None where its intervals are not few. Recognition's
    candidates placed alike, made in one call; each holds a term once, so nothing is folded (as `intervals` folds)."""
    found: list = []
    n = frame.n  # once: every tree's labels must cover the same positions
    for tree in trees:
        leaves = [tree] if isinstance(tree, Term) else ex.leaves(tree)
        try:
            queries = [term.kind.queries(term.values) for term in leaves if term.kind.queries is not None]
            if queries and queries[0] != frame.q_len:
                raise MaskError(f"--len {frame.q_len} does not match the {queries[0]} draft tokens of the tree")
            for term in leaves:
                count = term.kind.sequence(term.values) if term.kind.sequence is not None else None
                if count is not None and count != n:
                    raise MaskError(f"the labels of {term.kind.name} have {count} entries, the mask {n} positions")
                if term.kind.check is not None:
                    term.kind.check(term.values, frame, term.kind.name)
            found.append(_intervals(tree, frame))
        except MaskError as error:
            found.append(error)
        except NotFew:
            found.append(None)
    return found


def _intervals(tree, frame: Frame) -> Intervals:
    if isinstance(tree, ex.And):
        return functools.reduce(lambda a, b: a & b, (_intervals(item, frame) for item in tree.items))
    if isinstance(tree, ex.Or):
        return functools.reduce(lambda a, b: a | b, (_intervals(item, frame) for item in tree.items))
    if isinstance(tree, ex.Not):
        return ~_intervals(tree.item, frame)
    return _made(tree.kind.intervals(tree.values, frame), frame)


def _made(found, frame: Frame) -> Intervals:
    """A kind's intervals: as it made them, or its bounds (starts, ends) normalised on the frame's keys."""
    return found if isinstance(found, Intervals) else Intervals.of(*found, frame.k_start, frame.k_end)


def predicate(tree, frame: Frame, device):
    """mask_mod(b, h, q, kv) on absolute positions for the whole tree (torch), repeated terms folded first."""
    return _predicate(folded(tree), frame, device)


def _predicate(tree, frame: Frame, device):
    if isinstance(tree, ex.And):
        parts = [_predicate(item, frame, device) for item in tree.items]

        def and_mask(b, h, q_idx, kv_idx):
            result = parts[0](b, h, q_idx, kv_idx)
            for part in parts[1:]:
                result = result & part(b, h, q_idx, kv_idx)
            return result

        return and_mask
    if isinstance(tree, ex.Or):
        parts = [_predicate(item, frame, device) for item in tree.items]

        def or_mask(b, h, q_idx, kv_idx):
            result = parts[0](b, h, q_idx, kv_idx)
            for part in parts[1:]:
                result = result | part(b, h, q_idx, kv_idx)
            return result

        return or_mask
    if isinstance(tree, ex.Not):
        inner = _predicate(tree.item, frame, device)

        def not_mask(b, h, q_idx, kv_idx):
            return ~inner(b, h, q_idx, kv_idx)

        return not_mask
    return tree.kind.predicate(tree.values, frame, device)


def is_causal(tree) -> bool:
    """True when no query can see a later key, whatever the parameters (an And with a causal kind)."""
    if isinstance(tree, ex.And):
        return any(is_causal(item) for item in tree.items)
    if isinstance(tree, ex.Or):
        return all(is_causal(item) for item in tree.items)
    if isinstance(tree, ex.Not):
        return False
    return tree.kind.causal
