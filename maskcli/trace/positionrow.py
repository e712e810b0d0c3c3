"""The padding row of a model's learned position table, where the program handed the model its positions itself.

RoBERTa's family (XLM-R, CamemBERT, MPNet, Longformer, LayoutLMv3, ESM; fairseq's LearnedPositionalEmbedding) keeps one
row of its position table for padding, `nn.Embedding(..., padding_idx=p)`: a zero row no gradient reaches, given to
pad tokens, while its own numbering puts a row's real tokens at p + 1 onward. Read at an outermost model call that was
handed a `position_ids` tensor: the padding_idx of the position table the module holds (an nn.Embedding named for
positions, trace/positionsat.py's names) and its name; checks/positionrow.py reads the handed positions against it.
Nothing where transformers' generation code made the call: generate numbers any model's positions from 0 itself (a
library's choice, not the program's)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping

import torch

from maskcli.trace.padded import MOST  # (elements of one argument read at most, tops.py's one limit)
from maskcli.trace.positionsat import POSITION

_TABLES: dict = {}  # id(module) -> (weakref to it, (padding_idx, table's name) or None)
_GENERATION = os.sep + os.path.join("transformers", "generation") + os.sep
FRAMES = 6  # frames read outward from the model call for transformers' generation loop (torch's own in between)


def _table(module):
    """(padding_idx, name) of the module's learned position table where that table keeps a padding row, else None."""
    got = _TABLES.get(id(module))
    if got is None or got[0]() is not module:
        found = next(((m.padding_idx, name) for name, m in module.named_modules()
                      if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None
                      and POSITION.search(name.rsplit(".", 1)[-1])), None)
        if len(_TABLES) >= 64:
            _TABLES.clear()
        got = _TABLES[id(module)] = (weakref.ref(module), found)
    return got[1]


def _handed(given: dict) -> tuple[dict, str | None] | None:
    """(the fields holding `position_ids`, the name of the argument that held them or None) of one call: its own
    arguments, else one batch dict it was handed (sentence-transformers' `features`, handed on to the model inside)."""
    if issubclass(type(given.get("position_ids")), torch.Tensor):
        return given, None
    for name, value in given.items():
        if isinstance(value, Mapping) and issubclass(type(value.get("position_ids")), torch.Tensor):
            return value, name
    return None


def _numpy(value):
    """int64 numpy (B, L) of a small 1-D or 2-D integer (or bool) tensor, else None."""
    if not issubclass(type(value), torch.Tensor) or value.dim() not in (1, 2) or value.numel() > MOST \
            or value.is_floating_point() or value.is_complex() or value.device.type == "meta":
        return None
    return value.detach().reshape(-1, value.shape[-1]).to("cpu", torch.int64).numpy().copy()


def padding_row(module, given: dict, caller) -> dict:
    """{"position_padding_row": {"row", "table", "positions", "ids", "mask", "held_by"}} of an outermost call handed
    `position_ids` (or a batch dict holding them) by code other than transformers' generation loop, whose module's
    position table keeps a padding row: that row, the table's name, and the positions, ids and attention_mask of the
    fields that held them (int64 (B, L) or None); else {}."""
    fields = _handed(given)
    if fields is None:
        return {}
    frame, depth = caller, 0
    while frame is not None and depth < FRAMES:
        if _GENERATION in frame.f_code.co_filename:
            return {}
        frame, depth = frame.f_back, depth + 1
    table, positions = _table(module), _numpy(fields[0].get("position_ids"))
    if table is None or positions is None:
        return {}
    return {"position_padding_row": {
        "row": table[0], "table": table[1], "positions": positions, "held_by": fields[1],
        "ids": _numpy(fields[0].get("input_ids")), "mask": _numpy(fields[0].get("attention_mask"))}}
