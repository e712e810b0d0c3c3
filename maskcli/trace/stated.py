"""The configs a traced program states its attention in (maskcli.checks.intent), found once per outermost module.

Read at the first call of each outermost module and kept as fields only (nothing the program holds is kept or
changed): the config-like attributes of the module and every module under it (`self.config`, `self.cfg`, a
dataclass, a dict, or a config its class keeps), each for the calls at or under the module that holds it; else the
config-like variables of the program's own frames at that call (its main module's top level, the function that
built and called the model) and of the program's modules that define the model's classes, which speak for every
call where they are one config.
"""

from __future__ import annotations

import os
import sys
import sysconfig

import torch

from maskcli.checks.intent import NAMES, Stated, config_like, fields_of

FRAMES = 12  # program frames searched for config variables (the call's own and its callers)
SKIP = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks")


def stated(module, path, cache: dict) -> tuple[Stated, ...]:
    """The Stated configs for an outermost module (`path(module)`: the prefix of its calls' `where`), read once."""
    held = cache.get(id(module))
    if held is not None and held[0] is module:
        return held[1]
    found = _held(module, path)
    if not found:
        found = _variables(module)
    cache[id(module)] = (module, tuple(found))
    return cache[id(module)][1]


def _held(root, path) -> list[Stated]:
    """Each config once, at the highest module that holds it (a transformers model's every layer holds its own),
    modules visited parents first."""
    found, fields_by_id, scopes = [], {}, {}
    for module in root.modules():
        scope = path(module)
        kept = {name: value for name, value in vars(type(module)).items() if name in NAMES}  # (a config the class keeps)
        for name, value in [*kept.items(), *vars(module).items()]:
            if name in SKIP or name.startswith("__") or isinstance(value, (torch.nn.Module, torch.Tensor)):
                continue
            if scope is None or not config_like(value, named=name in NAMES):
                continue
            higher = scopes.get(id(value), ())
            if any(s == "" or scope == s or scope.startswith(s + ".") for s in higher):
                continue  # said already for this module and those under it
            if id(value) not in fields_by_id:
                fields_by_id[id(value)] = (value, fields_of(value))  # (the value held too: its id stays its own)
            fields = fields_by_id[id(value)][1]
            scopes[id(value)] = (*higher, scope)
            if fields:
                label = f"self.{name} of {scope or type(module).__name__} ({type(value).__name__})"
                found.append(Stated(label, scope, fields))
    return found


def _variables(root) -> list[Stated]:
    """The program's one config variable: in its frames at this call (the function that built and called the model,
    its main module's top level), else at the top of the program's modules that define the model's classes (torch's,
    maskcli's, installed packages' and the standard library's left out); [] where there is none, or several that
    differ (nothing says which is the model's)."""
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip = tuple({os.path.dirname(torch.__file__), own, *(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))})
    places, frame, searched = [], sys._getframe(1), 0
    while frame is not None and searched < FRAMES:
        name = frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<"):
            searched += 1
            code, file = frame.f_code.co_name, os.path.basename(name)
            places.append((f"at the top of {file}" if code == "<module>" else f"in {code}() of {file}", frame.f_locals))
        frame = frame.f_back
    for held in {type(module).__module__: None for module in root.modules()}:
        module = sys.modules.get(held)
        name = getattr(module, "__file__", None) or ""
        if name and not name.startswith(skip):
            places.append((f"at the top of {os.path.basename(name)}", vars(module)))
    found, seen = [], set()
    for where, variables in places:
        for variable, value in list(variables.items()):
            if id(value) in seen or variable.startswith("_") or not config_like(value):
                continue
            seen.add(id(value))
            fields = fields_of(value)
            if fields:
                found.append(Stated(f"{variable} ({type(value).__name__}) {where}", None, fields))
    distinct = {repr(sorted((k, repr(v)) for k, v in one.fields.items())) for one in found}
    return found[:1] if len(distinct) == 1 else []
