"""Padding masked although the program states it is not to be: a wrapper's flag against the mask it still hands on.

A module that holds a model and calls it (mosaicml/diffusion's `StableDiffusion` holding its CLIP text encoder and
its U-Net) may state whether that model's padding is masked: `self.mask_pad_tokens = False` (and its kin,
trace/stated.py PADDING_FLAGS, read off the module in the program's frames at the call that holds the called model).
Where it says False, the model was trained attending to its pad tokens; a call that is still handed a padding mask
(`attention_mask` / `encoder_attention_mask` with 0s) and hides those keys from a query that would otherwise see
them gives different outputs from the ones trained (mosaicml/diffusion#147: the tokenizer's mask passed at generation
regardless of the flag). The program's own flag contradicts the mask: wrong. A flag True, or no mask handed on, is
quiet; so is a mask of all 1s.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding

ARGUMENTS = ("attention_mask", "encoder_attention_mask")  # (1 = a real token)


def _flag(top) -> tuple[str, str] | None:
    """(the flag's name, where it was said) of a False padding flag the program states for `top`; None if none."""
    for said in top.stated or ():
        for name, value in said.fields.items():
            if name.startswith(("mask_pad", "use_pad")) and value is False:
                return name, said.source
    return None


def flag_masked(run: Run) -> list:
    """(call, Finding) for a call handed padding that it masks where the program's flag says padding is not masked."""
    found, done = [], set()
    for call in [*run.calls, *run.cross]:
        top = run.top(call)
        flag = _flag(top) if top is not None else None
        if flag is None or call.stored is None:
            continue
        rows, _, q_len, k_len = call.shape
        for name in ARGUMENTS:
            given = top.arguments.get(name)
            if not isinstance(given, np.ndarray) or given.shape != (rows, k_len) or not np.isin(given, (0, 1)).all() \
                    or given.all() or (call.where, name) in done:
                continue
            cells = keep(call)
            if cells is None or cells.shape[0] not in (1, rows):
                continue
            cells = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
            padded = given == 0
            reach = np.ones((q_len, k_len), dtype=bool)
            if name == "attention_mask" and call not in run.cross:
                own = queries(call, top)
                before = np.arange(k_len)[None, :] <= own[:, None]  # (q_len, k_len): keys at or before each query
                if not (cells & ~before[None]).any():  # (causal: a later key is hidden by that, not by padding)
                    reach = before
            asking = cells.any(axis=-1)  # (a query that sees nothing is no query this judges)
            hidden = ~cells & padded[:, None, :] & reach[None] & asking[:, :, None]
            if hidden.any():
                done.add((call.where, name))
                b, q, k = first_cell(hidden)
                flagname, source = flag
                found.append((call, Finding("padding-masked-despite-flag", (
                    f"batch row {b}: query {q} is kept from key {k}, padding by the {name} given to {top.where} "
                    f"({int(hidden.sum())} such cells), though {source} states {flagname}=False: the padding is masked "
                    f"where the program says it is attended (hand on no {name} when {flagname} is False)"),
                    expected=f"padding keys attended ({flagname}=False)", source=source, cell=(b, q, k))))
    return found


RULES = (
    Rule("padding-masked-despite-flag", "wrong", "call", "a padding mask handed on and applied where the module that "
         "calls the model states its padding is not masked (mask_pad_tokens=False)", flag_masked),
)
