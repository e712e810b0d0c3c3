"""The tokenizer a traced program holds where it calls its model: its pad id, EOS / BOS ids and padding side.

Read once per outermost module (trace/tops.py), where neither the module's config nor the module states a pad id:
the nearest program frames (the function that called the model and its callers; torch's and maskcli's left out)
are searched for one object, not a module or a tensor (or one such object kept as `tokenizer` /
`processing_class` / `processor` by an object they hold: a collator's), that has an int `pad_token_id` and an
`eos_token_id` or a `padding_side` (a transformers tokenizer, a stand-in of the program's own), or a config of the
program's own (a dataclass, or a class named `...Config`) with an int `pad_token_id` alone (verl's engine config, which
pads the batch). Two that differ: nothing is read.
Where no such object is held, an int those functions keep as `pad_id` / `pad_token_id` (a `generate(..., pad_id=0)`
of the program's own: torchtune's), or a constant the program's top level names so (`PAD_TOKEN_ID = 0`, OpenRLHF's
reproduction), is the pad id, where they name one value only. Where neither is, the one EOS id
(`eos_token_id`, or `eos_id` as sentencepiece and tiktoken wrappers name it) of a tokenizer with no pad id (held as
`tokenizer`, or of a class named `...Tokenizer`) is kept alone: the EOS the data was tokenized with, which
checks/boundaries.py holds against the one the model's mask splits on.
Kept as `tokenizer_pad_id`, `tokenizer_eos_id`, `tokenizer_bos_id`, `padding_side` and `tokenizer` (where it was
found) in the model call's arguments (checks/tokens.py reads them).
"""

from __future__ import annotations

import os
import sys
import weakref

import torch

from maskcli.checks.intent import read

FRAMES = 6  # program frames searched
PAD_NAMES = ("pad_id", "pad_token_id", "pad_idx", "pad_index")  # an int local of a function that calls the model
TOP_PAD_NAMES = ("PAD_ID", "PAD_TOKEN_ID", "PAD_IDX", "PAD_INDEX")  # a constant at the top of the main module


def tokenizer(module, frame=None) -> dict:
    """What the tokenizer the program's frames hold states (module docstring), read once per module: from `frame` on
    (the caller of the module's call, kept as it began: trace/capture.py), else from the caller's caller."""
    held = _HELD.get(module)
    if held is not None:
        return held
    found = _search(frame)
    try:
        _HELD[module] = found
    except TypeError:
        pass
    return found


def _int(value) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _search(frame=None) -> dict:
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "<")
    frame, searched, found, named, eos_only = sys._getframe(2) if frame is None else frame, 0, {}, {}, {}
    while frame is not None and searched < FRAMES:
        if not frame.f_code.co_filename.startswith(skip):
            searched += 1
            top = frame.f_code.co_name == "<module>"  # (a function's own pad id: torchtune's generate(..., pad_id=0);
            for name in PAD_NAMES if not top else TOP_PAD_NAMES:  # the main module's constant: `PAD_TOKEN_ID = 0`)
                pad = _int(frame.f_locals.get(name))
                if pad is not None:
                    named.setdefault(pad, f"{name}={pad} {'at the top of' if top else f'in {frame.f_code.co_name}() of'} "
                                          f"{os.path.basename(frame.f_code.co_filename)}")
            for name, value in _held(frame.f_locals):
                if id(value) in found or isinstance(value, (torch.nn.Module, torch.Tensor, type, int, str, dict)):
                    continue
                try:
                    pad = _int(read(value, "pad_token_id"))  # (read: never the program's __getattr__, which may count
                    side = read(value, "padding_side")  # or print)
                    eos = _int(read(value, "eos_token_id"))
                    bos = _int(read(value, "bos_token_id"))
                    if pad is None and eos is None and _tokenizer(name, value):  # (sentencepiece wrappers' names: NeMo's
                        pad, eos, bos = (_int(read(value, n)) for n in ("pad_id", "eos_id", "bos_id"))  # pad_id, eos_id)
                except Exception:  # noqa: BLE001 - a property of the program's that raises: not a tokenizer read here
                    continue
                where = "at the top of" if frame.f_code.co_name == "<module>" else f"in {frame.f_code.co_name}() of"
                if pad is None and _tokenizer(name, value):  # (a tokenizer with no pad id: its EOS alone, as `eos_id`
                    eos = eos if eos is not None else _int(read(value, "eos_id"))  # sentencepiece / tiktoken wrappers name it)
                    if eos is not None:
                        eos_only.setdefault(eos, {"tokenizer_eos_id": eos, "tokenizer": f"{name} ({type(value).__name__}) "
                                                  f"{where} {os.path.basename(frame.f_code.co_filename)}"})
                if pad is None or (eos is None and not isinstance(side, str) and not _config(value)):
                    continue
                found[id(value)] = {"tokenizer_pad_id": pad, **({"tokenizer_eos_id": eos} if eos is not None else {}),
                                    **({"tokenizer_bos_id": bos} if bos is not None else {}),
                                    **({"padding_side": side} if isinstance(side, str) and side in ("left", "right") else {}),
                                    "tokenizer": f"{name} ({type(value).__name__}) {where} "
                                                 f"{os.path.basename(frame.f_code.co_filename)}"}
        frame = frame.f_back
    said = list(found.values())
    if not said and len(named) == 1:  # no tokenizer object: one pad id the calling functions name as such
        pad, where = next(iter(named.items()))
        return {"tokenizer_pad_id": pad, "tokenizer": where}
    if not said and len(eos_only) == 1:  # no tokenizer with a pad id: the one EOS a tokenizer without one states
        return next(iter(eos_only.values()))
    if not said or any({k: v for k, v in one.items() if k != "tokenizer"} != {k: v for k, v in said[0].items()
                                                                               if k != "tokenizer"} for one in said[1:]):
        return {}
    return said[0]


def _tokenizer(name: str, value) -> bool:
    """A tokenizer by its name: held as `tokenizer` (or a collator's `.tokenizer`), or of a class named `...Tokenizer`."""
    return name.split(".")[-1] in HOLDERS[:1] or type(value).__name__.lower().endswith("tokenizer")


def _config(value) -> bool:
    """A config of the program's own: a dataclass instance, or an instance of a class named `...Config` / `...Cfg`."""
    kind = type(value)
    return hasattr(kind, "__dataclass_fields__") or kind.__name__.lower().endswith(("config", "cfg"))


HOLDERS = ("tokenizer", "processing_class", "processor")  # where a collator, trainer or pipeline keeps its tokenizer


def _held(variables: dict) -> list:
    """(name, object) of a frame's locals, and the tokenizer each holds under one of HOLDERS (a collator's
    `self.tokenizer`, held by the function that calls the model through its batch: flame's collator; a module's)."""
    found = list(variables.items())
    for name, value in list(found):  # (a module too: a NeMo model keeps its tokenizer as `self.tokenizer`)
        if isinstance(value, (torch.Tensor, type, int, float, str, dict, list, tuple)) or value is None:
            continue
        for holder in HOLDERS:
            try:
                held = value.__dict__.get(holder) if hasattr(value, "__dict__") else None
            except Exception:  # noqa: BLE001 - an object whose __dict__ cannot be read holds nothing we read
                held = None
            if held is not None:
                found.append((f"{name}.{holder}", held))
    return found


_HELD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # per module: read once, however many steps call it
