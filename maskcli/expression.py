"""Mask expressions: kinds combined with & (both allow), | (either allows), ~ (not) and parentheses.

    document(0,0,0,1,1,1) & window(2)
    causal | blocks(-1,-1,0,0,0,-1)
    causal & (window(1020) | sink(4))
    document(sizes=[3,5]) · document("labels.npy") · tril(-1) · triu(1, means=keep)

A string is parsed once, by the small grammar below, into an immutable tree; it is never
eval'ed. `~` binds tightest, then `&`, then `|`; `a & b & c` is one And of three items.

    expr    := and ('|' and)*
    and     := unary ('&' unary)*
    unary   := '~' unary | '(' expr ')' | call
    call    := NAME ['(' [args] ')']
    args    := (ints | STRING) [',' keyword]* | keyword (',' keyword)*
    ints    := INT ((',' | ';') INT)*            ';' separates batch rows
    keyword := NAME '=' (INT | '[' ints ']' | STRING | NAME)

`print_tree(parse(text))` is the canonical text; parsing it again gives an equal tree.
A bare NAME takes its parameters from the command-line flags (`window --window 3`);
`resolve` binds every call to its kind in the registry and checks its parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

from maskcli.errors import MaskError
from maskcli.text import shortened

# --- syntax ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ints:
    """Integers, in rows (`;` between batch rows); `bracketed` when written `[...]`."""

    rows: tuple[tuple[int, ...], ...]
    bracketed: bool = False


@dataclass(frozen=True)
class Text:
    """A string argument: quoted (`"labels.npy"`) or a bare word (`keep`)."""

    value: str
    quoted: bool = True


Value = Union[Ints, Text]


@dataclass(frozen=True)
class Call:
    """A kind as written: `window(3)`, or a bare `window` (called False: parameters from flags)."""

    name: str
    positional: Value | None = None
    keywords: tuple[tuple[str, Value], ...] = ()
    called: bool = False
    at: int = field(default=0, compare=False)  # character index, for messages


@dataclass(frozen=True)
class And:
    items: tuple


@dataclass(frozen=True)
class Or:
    items: tuple


@dataclass(frozen=True)
class Not:
    item: object


def both(*items) -> And:
    """And of the items, flattened: (a & b) & c is a & b & c."""
    flat: list = []
    for item in items:
        flat.extend(item.items if isinstance(item, And) else (item,))
    return And(tuple(flat))


def either(*items) -> Or:
    flat: list = []
    for item in items:
        flat.extend(item.items if isinstance(item, Or) else (item,))
    return Or(tuple(flat))


# --- tokens and parser ----------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<int>[+-]?[0-9]+)
      | (?P<string>"[^"]*"|'[^']*')
      | (?P<op>[()\[\],;=&|~])
    )""",
    re.VERBOSE,
)
MAX_TEXT = 1 << 20  # characters: inline labels past this belong in a file
# kind(sizes=[3,5;2,6]) and nothing else: read by str.split, not a token at a time (pack writes a million one-token
# documents as 2M characters, a minute for the tokenizer); the tree is the one the parser makes of it
_SIZES_ONLY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\(sizes=\[([0-9]{1,30}(?:[,;][0-9]{1,30})*)\]\)")


@dataclass(frozen=True)
class _Token:
    kind: str  # name, int, string, op, end
    text: str
    at: int


def _tokens(text: str) -> list[_Token]:
    tokens = []
    position = 0
    stop = len(text.rstrip())  # once: trailing blanks end the tokens (a test per token would be quadratic)
    while position < stop:
        match = _TOKEN.match(text, position)
        if match is None:
            at = position + len(text[position:]) - len(text[position:].lstrip())
            if text[at] == "." and tokens and tokens[-1].kind == "int":
                number = tokens[-1].text + re.match(r"\.[0-9]*", text[at:]).group()
                raise _error(text, at, f"{number} is not a whole number", "parameters are whole numbers, like window(3)")
            raise _error(text, at, f"unexpected character {text[at]!r}", "write kinds like window(3), joined by &, | and ~")
        kind = match.lastgroup
        tokens.append(_Token(kind, match.group(kind), match.start(kind)))
        position = match.end()
    tokens.append(_Token("end", "", len(text)))
    return tokens


def _error(text: str, at: int, problem: str, fix: str) -> MaskError:
    """One line that quotes the expression (its 40 characters either side of a long one's bad spot) and says where,
    with a pointer for a caret line under it (a terminal gets it)."""
    if len(text) <= 120:
        return MaskError(f"mask expression {text!r}: {problem} at character {at + 1}; {fix}", pointer=(text, at))
    lead = "..." if at > 40 else ""
    where = f"{lead}{text[max(0, at - 40) : at + 40]}{'...' if at + 40 < len(text) else ''}"
    problem = problem if len(problem) <= 120 else problem[:100] + "...'"
    return MaskError(f"mask expression of {len(text):,} characters: {problem} at character {at + 1} ({where!r}); {fix}",
                     pointer=(where, len(lead) + min(at, 40)))


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokens(text)
        self.i = 0

    @property
    def token(self) -> _Token:
        return self.tokens[self.i]

    def take(self, text: str | None = None, kind: str | None = None) -> _Token | None:
        token = self.token
        if (text is not None and token.text == text and token.kind == "op") or (kind is not None and token.kind == kind):
            self.i += 1
            return token
        return None

    def fail(self, expected: str, fix: str = "see maskcli kinds for every kind and its parameters") -> MaskError:
        token = self.token
        found = "the end" if token.kind == "end" else repr(token.text)
        return _error(self.text, token.at, f"expected {expected}, found {found}", fix)

    def expression(self):
        items = [self.conjunction()]
        while self.take("|"):
            items.append(self.conjunction())
        return items[0] if len(items) == 1 else either(*items)

    def conjunction(self):
        items = [self.unary()]
        while self.take("&"):
            items.append(self.unary())
        return items[0] if len(items) == 1 else both(*items)

    def unary(self):
        if self.take("~"):
            return Not(self.unary())
        if self.take("("):
            inner = self.expression()
            if not self.take(")"):
                raise self.fail("')' to close the '('", "close every '(' with a ')'")
            return inner
        name = self.take(kind="name")
        if name is None:
            raise self.fail("a kind name, '(' or '~'")
        if not self.take("("):
            return Call(name.text, at=name.at)
        positional, keywords = self.arguments(name.text)
        if not self.take(")"):
            raise self.fail(f"',' or ')' in the arguments of {name.text}", "separate arguments with ',' and close them with ')'")
        return Call(name.text, positional, tuple(keywords), called=True, at=name.at)

    def arguments(self, kind: str):
        positional = None
        keywords: list[tuple[str, Value]] = []
        if self.token.kind == "op" and self.token.text == ")":
            return positional, keywords
        if self.token.kind == "name" and self.tokens[self.i + 1].text == "=":
            keywords.append(self.keyword(keywords))
        elif self.token.kind == "int":
            positional = Ints(self.ints())
        elif self.token.kind == "string":
            positional = Text(self.take(kind="string").text[1:-1])
        else:
            raise self.fail(f"an integer, a quoted file name or name=value in {kind}(...)")
        while self.take(","):
            if not (self.token.kind == "name" and self.tokens[self.i + 1].text == "="):
                previous = keywords[-1] if keywords else None
                if previous is not None and self.token.kind == "int" and isinstance(previous[1], Ints) and not previous[1].bracketed:
                    raise self.fail("name=value after it", f"a list goes in brackets: {previous[0]}=[{previous[1].rows[0][0]},{self.token.text},...]")
                raise self.fail("name=value after the first argument", f"write it like {kind}(..., name=value)")
            keywords.append(self.keyword(keywords))
        return positional, keywords

    def keyword(self, seen) -> tuple[str, Value]:
        name = self.take(kind="name")
        if any(name.text == other for other, _ in seen):
            self.i -= 1
            raise self.fail(f"each name once, not {name.text} again", "give each parameter once")
        self.take("=")
        if self.take("["):
            rows = self.ints(bracketed=True)
            if not self.take("]"):
                raise self.fail("']' to close the list", "write lists like [3,5]")
            return name.text, Ints(rows, bracketed=True)
        if self.token.kind == "int":
            return name.text, Ints(((int(self.take(kind="int").text),),))
        if self.token.kind == "string":
            return name.text, Text(self.take(kind="string").text[1:-1])
        if self.token.kind == "name":
            return name.text, Text(self.take(kind="name").text, quoted=False)
        raise self.fail(f"a value after {name.text}=", f"write it like {name.text}=3 or {name.text}=[3,5]")

    def ints(self, bracketed: bool = False) -> tuple[tuple[int, ...], ...]:
        rows: list[list[int]] = [[]]
        while True:
            token = self.take(kind="int")
            if token is None:
                raise self.fail("an integer")
            if len(token.text.lstrip("+-")) > 30:  # far past int64; int() refuses text past 4,300 digits
                self.i -= 1
                raise self.fail("an integer of at most 19 digits", "no mask parameter is that large")
            rows[-1].append(int(token.text))
            if self.token.kind == "op" and self.token.text == "," and (bracketed or self.tokens[self.i + 1].kind == "int"):
                self.i += 1  # inside [...] a comma is always followed by the next integer: point at what is not one
            elif self.take(";"):
                rows.append([])
            else:
                return tuple(tuple(row) for row in rows)


def parse(text: str, max_text: int | None = MAX_TEXT):
    """The syntax tree of a mask expression; a MaskError that points at the bad character. `max_text`: the longest
    text a user may type (None for one maskcli wrote itself, like pack's document sizes)."""
    if not isinstance(text, str):
        raise TypeError(f"a mask expression is a str, like \"causal & window(3)\"; got {type(text).__name__}")
    if max_text is not None and len(text) > max_text:
        raise MaskError(f"the mask expression is {len(text):,} characters long: put long labels in a file, like document(\"labels.npy\")")
    if not text.strip():
        raise MaskError("the mask expression is empty: give a kind such as causal, or an expression such as \"causal & window(3)\"")
    sizes = _SIZES_ONLY.fullmatch(text)
    if sizes is not None:
        rows = tuple(tuple(map(int, row.split(","))) for row in sizes.group(2).split(";"))
        return Call(sizes.group(1), None, (("sizes", Ints(rows, bracketed=True)),), called=True)
    parser = _Parser(text)
    try:
        tree = parser.expression()
    except RecursionError:
        depth = max(text.count("("), text.count("~"))
        raise MaskError(
            f"the mask expression {shortened(text, 60)!r} nests about {depth:,} levels deep, more than maskcli reads: "
            "write it flatter (~~x is x; a & (b & c) is a & b & c)"
        ) from None
    if parser.token.kind != "end":
        raise parser.fail("'&', '|' or the end", "join kinds with & or |")
    return tree


# --- printing ------------------------------------------------------------------------------


def _ints_text(value: Ints) -> str:
    body = ";".join(",".join(str(v) for v in row) for row in value.rows)
    return f"[{body}]" if value.bracketed else body


def value_text(value: Value) -> str:
    if isinstance(value, Ints):
        return _ints_text(value)
    return _quote(value.value) if value.quoted else value.value


def _quote(text: str) -> str:
    return f"'{text}'" if '"' in text else f'"{text}"'


def call_text(call: Call) -> str:
    if not call.called:
        return call.name
    parts = [value_text(call.positional)] if call.positional is not None else []
    parts += [f"{name}={value_text(value)}" for name, value in call.keywords]
    return f"{call.name}({', '.join(parts)})"


def print_tree(node, leaf=call_text) -> str:
    """Canonical text with the fewest parentheses; `leaf` prints a call (or a resolved term)."""
    if isinstance(node, Or):
        return " | ".join(print_tree(item, leaf) for item in node.items)
    if isinstance(node, And):
        return " & ".join(_wrapped(item, leaf, (Or,)) for item in node.items)
    if isinstance(node, Not):
        return "~" + _wrapped(node.item, leaf, (Or, And))
    return leaf(node)


def _wrapped(node, leaf, kinds) -> str:
    text = print_tree(node, leaf)
    return f"({text})" if isinstance(node, kinds) else text


def simplified(node):
    """The same mask with repeats folded: A & A is A, A | A is A, ~~A is A, A & (A | B) is A, A | (A & B) is A.

    Nested & and | are flattened and each keeps its items in first-seen order. Evaluating a
    tree passes over every query row once per item, so a chain of 10,000 copies of one term
    is one pass after this, not 10,000. Leaves are compared by value (calls and terms are
    hashable); different leaves such as window(3) & window(5) stay as they are.
    """
    if isinstance(node, Not):
        inner = simplified(node.item)
        return inner.item if isinstance(inner, Not) else Not(inner)
    if not isinstance(node, (And, Or)):
        return node
    join, dual = (both, Or) if isinstance(node, And) else (either, And)
    flat = join(*(simplified(item) for item in node.items)).items
    distinct = list(dict.fromkeys(flat))
    present = set(distinct)
    # absorption: (A | B) beside A in an And adds nothing; (A & B) beside A in an Or neither
    kept = [item for item in distinct if not (isinstance(item, dual) and any(part in present for part in item.items))]
    return kept[0] if len(kept) == 1 else type(node)(tuple(kept))


def leaves(node) -> list:
    """The calls (or terms) of a tree, left to right."""
    if isinstance(node, (And, Or)):
        return [leaf for item in node.items for leaf in leaves(item)]
    if isinstance(node, Not):
        return leaves(node.item)
    return [node]


def with_leaves(node, replaced: list):
    """The same tree with its leaves, left to right (as `leaves` lists them), replaced by `replaced`'s: a caller
    that binds or rewrites leaves does it over the list, with no callback from here."""
    given = iter(replaced)
    return _rebuilt(node, given)


def _rebuilt(node, given):
    if isinstance(node, And):
        return And(tuple(_rebuilt(item, given) for item in node.items))
    if isinstance(node, Or):
        return Or(tuple(_rebuilt(item, given) for item in node.items))
    if isinstance(node, Not):
        return Not(_rebuilt(node.item, given))
    return next(given)
