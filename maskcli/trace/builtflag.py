"""The word a model was built with: `enc = RoutingTransformer(..., causal=False)` at the script's top level.

A model whose constructor takes `causal` (or `is_causal`, `bidirectional`) and keeps no such attribute states its
direction only in the statement that built it; an attention module under it that holds `causal = True` itself
(lucidrains/routing-transformer#57b1573: `LocalAttention(window, causal = True)` whatever the model was asked) runs
against that word (checks/builtcausal.py). Read only at calls whose innermost module holds causal=True
(details["module_causal"]): the script's top-level assignments are parsed once per file, and the outermost running
module is looked up among the few globals they name.
"""

from __future__ import annotations

import ast
import functools
import linecache
import sys

WORDS = {"causal": False, "is_causal": False, "bidirectional": True}  # keyword -> the value that says "both ways"


@functools.lru_cache(maxsize=16)
def _built(filename: str) -> tuple:
    """((global name, class name, keyword, line) ...) of each top-level `name = Class(..., causal=False)` (a method
    chain on it kept: `.eval()`, `.to(device)`), read once per script."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return ()
    found = []
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            continue
        value = node.value
        while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and isinstance(value.func.value, ast.Call):
            value = value.func.value  # (Class(...).eval())
        if not isinstance(value, ast.Call) or not isinstance(value.func, (ast.Name, ast.Attribute)):
            continue
        for keyword in value.keywords:
            if keyword.arg in WORDS and isinstance(keyword.value, ast.Constant) and keyword.value.value is WORDS[keyword.arg]:
                name = value.func.id if isinstance(value.func, ast.Name) else value.func.attr
                found.append((node.targets[0].id, name, f"{keyword.arg}={keyword.value.value}", node.lineno))
    return tuple(found)


def built_not_causal(stack: list) -> str | None:
    """'Class(causal=False) at line N of script.py' where the outermost running module is a global of the main script
    its top level built with a word that says both ways; None otherwise."""
    main = sys.modules.get("__main__")
    filename = getattr(main, "__file__", None)
    if not stack or not filename:
        return None
    variables = vars(main)
    for name, cls, word, line in _built(filename):
        if variables.get(name) is stack[0]:
            return f"{cls}({word}) at line {line} of {filename.rsplit('/', 1)[-1]}"
    return None
