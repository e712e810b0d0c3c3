"""Which layers a program states are local, in GPT-Neo's words: `attention_layers` / `attention_types` and `window_size`.

GPT-Neo's config names each layer's attention "global" or "local" (`attention_layers`, one word a layer, or
`attention_types`, [[pattern, repeats], ...], which transformers' GPTNeoConfig expands into it) and the keys a local
layer reads, `window_size` (its query's own key counted: transformers' modeling_gpt_neo.py keeps k > q - window_size).
checks/intent.py leaves these fields to no rule (OTHER_LAYERS); checks/locallayers.py reads what is recorded here.
SAM's image encoder states its the other way: `global_attn_indexes` lists the layers that attend over the whole patch
grid, every other of its `num_hidden_layers` attends within window_size x window_size windows (ViTDet lists those,
`window_block_indices`); read into the same per-layer words.

Read at each attention call, and kept only where a statement is found: a config a running module keeps under a
config's name (checks/intent.py NAMES: `config`, `cfg`, ...; a dict lookup a name, each module's answer kept), else
one the program's frames keep under such a name (their code's variable names matched once a code), else a
config-like value of the main module's globals (scanned again only when they grow). Where one is found, the call's
layer: the innermost program frame holding an int `layer_idx` / `layer_id` / `layer_index` (a decode loop with no
modules), read as "layer"; checks/locallayers.py falls back on the module path's number only where a running module
keeps the statement ("held": "module": a module outside it, another tower under the same script, is not its layer).
"""

from __future__ import annotations

import sys

from maskcli.checks.configread import field_reader
from maskcli.checks.intent import NAMES, NUMBERS, config_like

LAYERS, TYPES, WINDOW = "attention_layers", "attention_types", "window_size"
GLOBALS, WINDOWED = "global_attn_indexes", "window_block_indices"  # SAM's image encoder; ViTDet's
COUNTS = ("num_hidden_layers", "num_layers", "depth", "n_layers")
WORDS = ("global", "local")
_CODES: dict[int, tuple] = {}  # id(code) -> (code, its config names, its layer-number names)
_MODULES: dict[int, tuple] = {}  # id(module) -> (module, its statement or None)
_MAIN: list = [None, -1, None]  # [globals dict, its size when scanned, the statement found]


def note(details: dict, stack: list, api: str, shape: tuple, walked) -> None:
    """details["layer_kinds"] = {"kinds", "field", "window", "source", "layer", "layer_said"} where the program states
    GPT-Neo's per-layer kinds with a local layer and a window; nothing otherwise."""
    frames = [frame for frame, _ in walked.held] if walked is not None else []
    said = _in_modules(stack)
    found = None if said is None else {**said, "held": "module"}
    if found is None:
        said = _in_frames(frames) or _in_main()
        if said is None:
            return
        found = {**said, "held": "program"}  # (its layers numbered by the frames only: no module path speaks for it)
    for frame in frames:
        _, _, numbers = _names(frame.f_code)
        value = next((frame.f_locals.get(n) for n in numbers if type(frame.f_locals.get(n)) is int), None)
        if value is not None and value >= 0:
            name = next(n for n in numbers if frame.f_locals.get(n) == value)
            found["layer"], found["layer_said"] = value, f"`{name}` = {value} in {frame.f_code.co_name}"
            break
    details["layer_kinds"] = found


def stated(config) -> dict | None:
    """{"kinds", "field", "window", "keys", "said"} of a config (a dict or an object) stating which layers are "local"
    (at least one) and an int window_size > 0: "keys", the most keys a local layer's query reads (GPT-Neo's window, one
    more for a port that counts the keys before the query; a SAM window's window_size² patches), "said" that in words.
    None otherwise."""
    get = field_reader(config)
    window = get(WINDOW)
    if type(window) is not int or window <= 0:
        return None
    kinds, field = _words(get(LAYERS)), LAYERS
    if kinds is None:
        kinds, field = _expanded(get(TYPES)), TYPES
    if kinds:
        if "local" not in kinds:
            return None
        return {"kinds": kinds, "field": field, "window": window, "keys": window + 1,
                "said": f"its {window} newest keys"}
    kinds, field = _windowed(get, window)
    if not kinds or "local" not in kinds:
        return None
    return {"kinds": kinds, "field": field, "window": window, "keys": window * window,
            "said": f"the {window * window} patches of its {window}x{window} window"}


def _windowed(get, window: int) -> tuple[tuple | None, str]:
    """SAM's / ViTDet's image encoder: the layers in `global_attn_indexes` attend over the whole patch grid, the others
    within window_size x window_size windows (ViTDet names the windowed ones, `window_block_indices`), of a config
    stating its layer count."""
    count = next((c for c in map(get, COUNTS) if type(c) is int and 0 < c <= 1 << 12), None)
    if count is None:
        return None, ""
    for field, local in ((GLOBALS, False), (WINDOWED, True)):
        listed = get(field)
        if isinstance(listed, (list, tuple)) and all(type(i) is int for i in listed) and (listed or not local):
            chosen = {i % count for i in listed if -count <= i < count}
            return tuple("local" if (i in chosen) == local else "global" for i in range(count)), field
    return None, ""


def _words(value) -> tuple | None:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(x, str) for x in value):
        return None
    words = tuple(x.lower() for x in value)
    return words if set(words) <= set(WORDS) else None


def _expanded(value) -> tuple | None:
    """GPT-Neo's attention_types, [[["global", "local"], 12]], expanded as GPTNeoConfig.expand_attention_types_params."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    kinds = []
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or type(entry[1]) is not int or entry[1] < 1:
            return None
        pattern = _words(entry[0])
        if pattern is None or entry[1] * len(pattern) > 1 << 16:
            return None
        kinds += list(pattern) * entry[1]
    return tuple(kinds)


def _names(code) -> tuple:
    entry = _CODES.get(id(code))
    if entry is None or entry[0] is not code:
        names = code.co_varnames + code.co_cellvars + code.co_freevars
        entry = _CODES[id(code)] = (code, tuple(n for n in NAMES if n in names), tuple(n for n in NUMBERS if n in names))
    return entry


def _in_frames(frames: list) -> dict | None:
    for frame in frames:
        _, configs, _ = _names(frame.f_code)
        for name in configs:
            value = frame.f_locals.get(name)
            if value is not None and config_like(value, named=True):
                said = stated(value)
                if said is not None:
                    return {**said, "source": f"`{name}` in {frame.f_code.co_name} ({type(value).__name__})"}
    return None


def _in_modules(stack: list) -> dict | None:
    for module in reversed(stack):
        held = _MODULES.get(id(module))
        if held is None or held[0] is not module:
            found = None
            own = module.__dict__
            for name in NAMES:
                value = own.get(name)
                if value is not None and config_like(value, named=True):
                    said = stated(value)
                    if said is not None:
                        found = {**said, "source": f"self.{name} of {type(module).__name__} ({type(value).__name__})"}
                        break
            held = _MODULES[id(module)] = (module, found)
        if held[1] is not None:
            return held[1]
    return None


def _in_main() -> dict | None:
    main = getattr(sys.modules.get("__main__"), "__dict__", None)
    if not isinstance(main, dict):
        return None
    if _MAIN[0] is main and _MAIN[1] == len(main):
        return _MAIN[2]
    found = None
    for name, value in list(main.items()):
        if name.startswith("__") or isinstance(value, type) or not (isinstance(value, dict) or config_like(value)):
            continue
        said = stated(value)
        if said is not None:
            found = {**said, "source": f"`{name}` of the main module ({type(value).__name__})"}
            break
    _MAIN[:] = [main, len(main), found]
    return found
