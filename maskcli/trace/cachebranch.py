"""A module's forward that builds a causal mask where it is handed no cache, called with one (checks/causal_lm.py).

alpa's OPT serving attention (alpa-projects/alpa#608): `if attention_cache is None: attention_bias = triu(full(-1e10),
1)`, else a bias over the cache's slots that hides only the slots not written yet, so a whole prompt run through the
cache attends both ways. The module's own code states the layer causal, in the branch for no cache; a call handed the
cache ran the other branch. Read once per forward code (the program's own files only): an `if` whose test is a
parameter named like a cache (`X is None`, `X is not None`, `X`, `not X`), one of whose branches calls `triu(..., 1)`
or `tril(...)` (a causal mask's triangle) and the other none; then at each call from the innermost running module's
forward frame, whose parameter's value says the causal branch was not taken. Recorded as details
`cache_branch_causal` ("Class.forward builds a causal mask (triu at line N of file.py) where NAME is None").
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import textwrap

from maskcli.trace.builders import _own
from maskcli.trace.codes import ByCode
from maskcli.trace.forwardflag import forward_frame

CACHE = re.compile(r"cache|past|(?:^|_)kv(?:_|$)|layer_past", re.IGNORECASE)  # a parameter named like a cache
_BRANCHES = ByCode()  # forward code -> its branches (_branches), read once


def note(details: dict, stack: list, walked) -> None:
    """details["cache_branch_causal"] where the innermost running module's forward builds a causal mask only where its
    cache parameter is absent, and this call was handed that parameter."""
    if not stack or walked is None:
        return
    code = getattr(getattr(type(stack[-1]), "forward", None), "__code__", None)
    branches = None if code is None else _BRANCHES.get(code)
    if branches is None and code is not None:  # (read once per forward: most build no triangle, one id lookup a call)
        branches = _BRANCHES.put(code, _branches(code) if {"triu", "tril"} & set(code.co_names) else ())
    if not branches:
        return
    found = forward_frame(stack, walked.held, lambda _: True)
    if found is None:
        return
    frame, _ = found
    for name, causal_when_none, line, function in branches:
        value = frame.f_locals.get(name)
        if causal_when_none and value is not None and not (isinstance(value, (tuple, list, dict)) and not value):
            details["cache_branch_causal"] = (
                f"{type(stack[-1]).__name__}.forward builds a causal mask ({function} at line {line} of "
                f"{os.path.basename(code.co_filename)}) where {name} is None")
            return


def _branches(code) -> tuple:
    """((parameter, whether the triangle's branch is the one for None, line, 'torch.triu'), ...) of `code`'s ifs on a
    cache parameter whose one branch alone builds a triangle; () where none (or not the program's own code)."""
    if not _own(code.co_filename):
        return ()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()
    parameters = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        test = _cache_test(node.test, parameters)
        if test is None:
            continue
        name, body_when_none = test
        body, other = _triangle(node.body), _triangle(node.orelse)
        if (body is None) == (other is None):
            continue  # (both branches or neither build one)
        triangle = body or other
        found.append((name, body_when_none if body is not None else not body_when_none,
                      code.co_firstlineno + triangle[0] - 1, triangle[1]))
    return tuple(found)


def _cache_test(test, parameters: set) -> tuple[str, bool] | None:
    """(parameter, whether the if's body runs where it is None) for `X is None` / `X is not None` / `not X` / `X` on a
    parameter named like a cache; None for any other test."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Name):
        name, when_none = test.operand.id, True
    elif isinstance(test, ast.Name):
        name, when_none = test.id, False
    elif isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1 \
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None \
            and isinstance(test.ops[0], (ast.Is, ast.IsNot)):
        name, when_none = test.left.id, isinstance(test.ops[0], ast.Is)
    else:
        return None
    return (name, when_none) if name in parameters and CACHE.search(name) else None


def _triangle(statements: list) -> tuple[int, str] | None:
    """(line, 'torch.triu') of the first causal triangle built in `statements`: `triu(x, 1)` / `triu(x, diagonal=1)`,
    or `tril(x)` / `tril(x, 0)`; None where none is."""
    for statement in statements:
        for node in ast.walk(statement):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name not in ("triu", "tril"):
                continue
            given = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "diagonal")]
            diagonal = given[0].value if given and isinstance(given[0], ast.Constant) else 0 if not given else None
            if (name, diagonal) in (("triu", 1), ("tril", 0)):
                shown = f"{func.value.id}.{name}" if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                    else name
                return node.lineno, shown
    return None
