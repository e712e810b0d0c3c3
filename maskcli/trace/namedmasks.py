"""Token masks the program's functions are handed under a `<what>_mask` name: a batch's padding, its polarity unsaid.

NeMo's TTS transformers hand each layer `x_mask` and each attention `query_mask` ((B, L), 1 = a real token); VITS and
Glow-TTS hand `x_mask` as (B, 1, L). trace/held.py reads only the names that say which way round a mask is
(`attention_mask`, `*padding_mask`); these say only that they mask tokens. Read at each attention call from the
parameters of the program's frames trace/walk.py walked (names matched once per code object): a 2-D (B, L), or
(B, 1, L), tensor of 0/1 or bools under such a name is recorded as details `named_masks` ({name, where, rows}: bool
(B, L)), for checks/queryaxis.py, which reads it either way round and says something only where the call's own mask
agrees with one of them query row for query row. A tensor is read once per version.
"""

from __future__ import annotations

import os
import re

import torch

from maskcli.trace.codes import ByCode, named_parameters

NAMED = re.compile(r"^(?!attn_|attention_|causal_|key_padding_|padding_|pad_|loss_|label_)[a-z]\w*_mask$")
MOST = 1 << 16  # cells of one mask read at most

_NAMES = ByCode()  # code -> the parameter names matching NAMED
_READ: dict = {}  # id(tensor) -> (tensor, version, bool rows or None)


def note(details: dict, walked) -> None:
    """details["named_masks"] where the program's frames were handed token masks under a `<what>_mask` name."""
    if walked is None:
        return
    found, seen, tree = [], set(), False
    for _, code, name, value in named_parameters(walked, _NAMES, NAMED):
        if "tree" in name:  # (only the draft tree mask handed nearest the call is its: one a function further out
            if tree:  # holds belongs to another tree, OPT-Tree's verify() drafting the next; read or not, it shadows)
                continue
            tree = True
        rows = _read(value)
        if rows is not None and id(value) not in seen:
            seen.add(id(value))
            found.append({"name": name, "where": f"{code.co_name}() of {os.path.basename(code.co_filename)}",
                          "rows": rows})
    if found:
        details["named_masks"] = found


def _read(value):
    """Bool (B, L) of a 2-D or (B, 1, L) tensor of 0/1 or bools; None for anything else."""
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3) or value.dim() == 3 and value.shape[1] != 1 \
            or value.numel() > MOST or value.numel() == 0 or value.device.type == "meta" or value.shape[-1] < 2:
        return None
    held = None if value.is_inference() else _READ.get(id(value))  # (no version counter: read afresh)
    if held is not None and held[0] is value and held[1] == value._version:
        return held[2]
    cells = value.detach().reshape(value.shape[0], value.shape[-1]).cpu()
    rows = cells.numpy().astype(bool) if bool(((cells == 0) | (cells == 1)).all()) else None
    if len(_READ) > 256:
        _READ.clear()
    if not value.is_inference():
        _READ[id(value)] = (value, value._version, rows)
    return rows
