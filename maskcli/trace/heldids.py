"""Token ids a model call is handed inside a batch dict (a recommender's or a trainer's `model(x)`, `x["hist_item_id"]`),
with the pad id the model's embeddings state: read where the call was handed no ids by name (trace/tops.py)."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from maskcli.trace.padded import MOST

# fields of a batch dict that hold no token ids: masks, labels, positions, types, lengths, boxes, pixels
NOT_IDS = ("mask", "label", "position", "pos_", "type", "segment", "len", "box", "coord", "pixel", "time", "score")


def held_ids(given: dict, module, found: dict) -> dict:
    """{"held_ids": (where, int (B, L) ids, pad id)}: the 2-D integer tensors of a dict the model call was handed (one
    argument, its keys by name), padded with the one padding_idx every token embedding of the model that states one
    agrees on; each such field's padding (its cells at the pad id) the same. Nothing where the call was handed ids by
    name, where no embedding states a padding_idx, or where the fields' padding differs."""
    if any(name in found for name in ("input_ids", "idx", "tokens", "first_ids", "src", "src_tokens")):
        return {}
    batches = [(name, value) for name, value in given.items() if type(value) is dict and 0 < len(value) <= 64]
    if len(batches) != 1:
        return {}
    name, batch = batches[0]
    fields = [(f'{name}["{key}"]', value) for key, value in _fields(batch)]
    if not fields:
        return {}
    pad_id = _padding_idx(module)
    if pad_id is None:
        return {}
    arrays = [(key, value.detach().cpu().numpy().astype(np.int64)) for key, value in fields]
    shape, pads = arrays[0][1].shape, arrays[0][1] == pad_id
    if any(ids.shape != shape or not np.array_equal(ids == pad_id, pads) for _, ids in arrays[1:]):
        return {}
    if np.isin(arrays[0][1], (0, 1)).all():  # (a 0/1 field is a mask, whatever its name)
        return {}
    keys = ", ".join(key for key, _ in arrays)
    return {"held_ids": (keys, arrays[0][1], pad_id)}


def _fields(batch: dict) -> list:
    """(key, value) of the batch dict's 2-D integer fields whose names say no mask, label, position..., with those of
    dicts one level inside it (AllenNLP's TextFieldTensors: `{"tokens": {"token_ids": ..., "mask": ...}}`, one dict
    per indexer) keyed `outer"]["inner`."""
    found = []
    for key, value in batch.items():
        if not isinstance(key, str) or any(word in key.lower() for word in NOT_IDS):
            continue
        if type(value) is dict and 0 < len(value) <= 64:
            found += [(f'{key}"]["{inner}', field) for inner, field in value.items() if isinstance(inner, str)
                      and type(field) is not dict and not any(word in inner.lower() for word in NOT_IDS) and _ids(field)]
        elif _ids(value):
            found.append((key, value))
    return found


def _ids(value) -> bool:
    """A 2-D integer tensor of two columns at least, small enough to keep."""
    return issubclass(type(value), torch.Tensor) and value.dim() == 2 and value.shape[1] > 1 \
        and not value.is_floating_point() and value.dtype != torch.bool and value.numel() <= MOST \
        and value.device.type != "meta"


def _padding_idx(module) -> int | None:
    """The padding_idx every nn.Embedding of the model that states one agrees on (a recommender keeps a table per
    feature, its id features unpadded); None where none states one or two differ."""
    try:
        return _PADS[module]
    except (KeyError, TypeError):
        pass
    found = {int(m.padding_idx) for m in module.modules() if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None}
    pad_id = found.pop() if len(found) == 1 else None
    try:
        _PADS[module] = pad_id
    except TypeError:
        pass
    return pad_id


_PADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # per model: read once, however many steps call it
