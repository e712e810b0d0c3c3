"""The names a script's top-level statement reads, followed back through the script's top-level assignments.

A script keeps its batch at its top level (`lengths = [6, 4]`, then `pad = arange(L) < lengths`, then
`encoder(x, src_key_padding_mask=pad)`): what it states there is the padding of the call the statement running makes
only where that statement reads it whole, directly or through the names it was built from. A global the running
statement never reads, or reads a part of (`lengths[b:b + 1]`), is another batch's: the lengths of a batched run are
still held while the script runs each sample alone after it (`for b ...: model(x[b:b + 1])`), and are no statement
about those calls.
"""

from __future__ import annotations

import ast
import functools
import linecache

DEPTH = 8  # assignments followed back from the running statement at most


def read_by(code, line: int) -> frozenset:
    """The global names the top-level statement of `code` (a module's code) at `line` reads, with the names every
    top-level assignment of those names read, DEPTH assignments back; empty where the source cannot be read."""
    return _read_by(code.co_filename, line)


@functools.lru_cache(maxsize=1024)
def _read_by(filename: str, line: int) -> frozenset:
    """read_by, once per script line (a script's loop makes its attention calls from one line, over and over)."""
    statements, assigned = _parsed(filename)
    running = None
    for first, last, names in statements:  # (the innermost statement at the line: the shortest that holds it)
        if first <= line <= last and (running is None or last - first < running[1] - running[0]):
            running = (first, last, names)
    if running is None:
        return frozenset()
    found, new = set(running[2]), set(running[2])
    for _ in range(DEPTH):
        new = {name for held in new for name in assigned.get(held, ())} - found
        if not new:
            break
        found |= new
    return frozenset(found)


@functools.lru_cache(maxsize=32)
def _parsed(filename: str) -> tuple[tuple, dict]:
    """((first line, last line, the names its own expressions load) of each top-level statement, nested ones in
    loops, `with` and `if` blocks too; name -> the names its top-level assignments load), read once per script."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return (), {}
    statements, assigned = [], {}
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # (a function's own names are its frame's: held.py reads them there)
        inner = [child for field in ("body", "orelse", "finalbody", "handlers") for child in getattr(node, field, ())
                 if isinstance(child, ast.stmt)]
        stack.extend(inner)
        heads = [value for key, value in ast.iter_fields(node) if key not in ("body", "orelse", "finalbody", "handlers")]
        parts = {id(n.value) for head in heads for n in _walk(head) if isinstance(n, ast.Subscript) and _part(n.slice)}
        loads = {n.id for head in heads for n in _walk(head) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                 and id(n) not in parts}  # (`lengths[b:b + 1]` reads one sample's part, not the batch's lengths)
        end = node.lineno if inner else getattr(node, "end_lineno", node.lineno)
        statements.append((node.lineno, end, frozenset(loads)))
        stores = {n.id for head in heads for n in _walk(head) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for name in stores:
            assigned.setdefault(name, set()).update(loads - {name})
    return tuple(statements), assigned


def _part(index) -> bool:
    """An index that takes some samples of a batch (`[b]`, `[b:b + 1]`), not one that views all of them on more axes
    (`lengths[:, None]`, `lengths[None]`, `[..., None]`): its first item, on the batch axis, not a whole slice."""
    first = index.elts[0] if isinstance(index, ast.Tuple) and index.elts else index
    if isinstance(first, ast.Slice):
        return not (first.lower is None and first.upper is None and first.step is None)
    return not (isinstance(first, ast.Constant) and (first.value is None or first.value is Ellipsis))


def _walk(value):
    """ast.walk over a statement's field (a node or a list of them)."""
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, ast.AST):
            yield from ast.walk(item)
