"""A model call's padding stated twice: a 0/1 mask named as a padding mask beside a float input that is exactly zero
across the mask's padded run (checks/padded.py holds the two against the attention: zero-padding-attended); a 0/1
mask named for an integer input beside it, kept with that input's tokens as ids (checks/plainpad.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import torch

from maskcli.checks.configread import read
from maskcli.checks.real import LENGTHS  # (each row's real tokens, by the names a model call takes them)

MOST = 1 << 20  # elements of one model-call argument kept (a batch's 2-D ids; never a 4-D mask): tops.py's too


_PADDING_NAME = re.compile(r"^(?:\w+_)?(?:attention|padding|pad)_mask$|^(?:input_)?mask$"  # (padding_, pad_: True = pad)
                           r"|^(?:insample|available)_mask$")  # (a forecaster's window: 1 = a sample of the series,
# neuralforecast's names; not `past_observed_mask`, which transformers' time-series models read for scaling alone)
BATCH_FIELDS = 64  # fields of a batch dict the model call is handed, read at most (trace/heldids.py's bound)


def padded_input(given: dict) -> dict:
    """{"padded_input": (mask name, its values (S,) or (B, S), input name, bool (B, S) where the input is exactly 0)}:
    a model call handed a 0/1 mask named as a padding mask with a 0 in it (any dtype, 1-D too: a forecaster's
    `mask=input_mask`) beside a float input (B, S) or (B, C, S) / (B, S, C) with an axis of the mask's S samples: the
    data's own padding, to hold the mask against (checks/padded.py). Read only where such a mask is handed."""
    given = {**given, **_batch_fields(given)}
    masks = [(name, value) for name, value in given.items() if isinstance(value, torch.Tensor)
             and _PADDING_NAME.search(name.rsplit('["', 1)[-1].rstrip('"]'))
             and value.dim() in (1, 2) and 1 < value.shape[-1] and value.numel() <= MOST and value.device.type != "meta"]
    for name, value in masks:
        length = value.shape[-1]
        inputs = [(other, data, axis) for other, data in given.items() if other != name
                  and (axis := _samples_axis(data, length)) is not _NOT]
        if not inputs:  # (shapes alone first: a decoder's step hands ids and positions, no float input, so its mask's
            continue  # values are never read: six torch calls a step, ~0.1 ms in a traced step whose caches are cold)
        values = value.detach().cpu()
        if not bool(((values == 0) | (values == 1)).all()) or bool(values.bool().all()) or not bool(values.bool().any()):
            continue
        other, data, axis = inputs[0]
        zero = data.detach() == 0
        zero = (zero if axis is None else zero.all(axis)).cpu().numpy()  # (B, S); (B, C, S): all(1); (B, S, C): all(2)
        return {"padded_input": (name, values.numpy().astype(np.int64), other, zero)}
    return {}


def _batch_fields(given: dict) -> dict:
    """{'batch["field"]': tensor}: the tensor fields of each batch dict the model call is handed (neuralforecast's
    `windows_batch`, a trainer's `batch`), where its padding mask and its input sit side by side."""
    return {f'{name}["{key}"]': field for name, value in given.items() if type(value) is dict
            and 0 < len(value) <= BATCH_FIELDS for key, field in value.items()
            if isinstance(key, str) and isinstance(field, torch.Tensor)}


def nested_ids(given: dict, found: dict) -> dict:
    """{"nested_ids": (name, int (..., L) ids)}: a model call's 3-D or 4-D integer argument beside the pad id its model
    states (RETRO's `retrieved`, (batch, chunks, neighbours, tokens), `self.pad_id`), under any name: ids whose leading
    axes the attention folds into its batch rows (checks/real.stated flattens them to a call's rows). Read only where a
    pad id is stated, the first such argument."""
    if not isinstance(found.get("pad_id"), int):
        return {}
    for name, value in given.items():
        if any(word in name for word in ("mask", "position", "box", "coord", "label", "pixel")):
            # (a 4-D 0/1 mask, 3-D rope positions, LayoutLM's (B, L, 4) bbox, labels or pixels: no token ids)
            continue
        if issubclass(type(value), torch.Tensor) and value.dim() in (3, 4) and value.dtype in (torch.int64, torch.int32) \
                and value.numel() <= MOST and value.device.type != "meta":  # (token ids: never a uint8 image)
            return {"nested_ids": (name, value.detach().cpu().numpy().astype(np.int64))}
    return {}


def lengths_over(signature, given: dict) -> dict:
    """{"lengths_over": T}: where a model call is handed each row's length (LENGTHS, (B,)), the positions its first
    argument has, (B, T, ...) or sequence-first (T, B, ...): what the lengths count. An attention over more keys than
    that (a summary or memory token appended, a CLS prepended) holds keys the lengths do not place (checks/real.py)."""
    rows = next((value.shape[0] for name in LENGTHS if issubclass(type(value := given.get(name)), torch.Tensor)
                 and value.dim() == 1), None)
    if rows is None or signature is None:
        return {}
    first = given.get(next((n for n in signature.parameters if n != "self"), None))
    if not issubclass(type(first), torch.Tensor) or first.dim() < 2 or rows not in first.shape[:2]:
        return {}
    return {"lengths_over": int(first.shape[1] if first.shape[0] == rows else first.shape[0])}


_NOT = object()  # (_samples_axis: no axis of the mask's samples)


def _samples_axis(data, length: int):
    """The axis a float input (B, S), (B, C, S) or (B, S, C) folds to reach (B, S) of the mask's `length` samples:
    None for (B, S) itself, 1 or 2, else _NOT (no axis of its samples: never compared, no pass over its cells)."""
    if not isinstance(data, torch.Tensor) or not data.is_floating_point() or data.dim() not in (2, 3) \
            or data.numel() > MOST or data.device.type == "meta":
        return _NOT
    if data.dim() == 2:
        return None if data.shape[1] == length else _NOT
    return 1 if data.shape[2] == length else 2 if data.shape[1] == length else _NOT


def input_mask(given: dict) -> dict:
    """{"input_mask_of": (mask name, input name, int (B, L) mask, int (B, L) ids)}: the first argument `<x>_mask`, a 2-D
    0/1 integer or bool tensor, beside an integer argument `<x>` of (B, L) or (B, L, F) whose leading axes are the
    mask's (surya's reading-order decoder: boxes (B, L, 4) and their mask). Each token of `<x>` is read as one id (a
    box of F coordinates: one id per distinct box), so a pad box is one id as a pad token is."""
    for name, mask in given.items():
        source = given.get(name[:-len("_mask")]) if name.endswith("_mask") else None
        if not issubclass(type(mask), torch.Tensor) or not issubclass(type(source), torch.Tensor) \
                or mask.dim() != 2 or source.dim() not in (2, 3) or tuple(source.shape[:2]) != tuple(mask.shape) \
                or source.is_floating_point() or source.dtype == torch.bool or mask.is_floating_point() \
                or source.numel() > MOST or "meta" in (mask.device.type, source.device.type):
            continue
        flags = mask.detach().cpu().numpy().astype(np.int64)
        if flags.size == 0 or flags.min() < 0 or flags.max() > 1:
            continue
        tokens = source.detach().cpu().numpy().astype(np.int64)
        tokens = tokens.reshape(tokens.shape[0] * tokens.shape[1], -1)
        ids = np.unique(tokens, axis=0, return_inverse=True)[1].reshape(flags.shape)
        return {"input_mask_of": (name, name[:-len("_mask")], flags, ids)}
    return {}


PAYLOADS = ("payload", "padded", "data")  # (the padded tensor a batch object holds beside its rows' lengths)


def batch_object(signature, given: dict) -> dict:
    """{first argument's name: its padded tensor, "lengths": each row's length} where a model call's first argument is
    a batch object holding both as attributes (pytorch-lifestream's PaddedBatch: `payload`, a tensor or a dict of one per
    feature, and `seq_lens`), read statically (checks/configread.read: never the object's __getattr__); {} else, or
    where the call is handed lengths by name. Or the fields of a tokenizer's output that such an object (a NamedTuple,
    a dataclass) holds (_encoding)."""
    name = next((n for n in signature.parameters if n != "self"), None) if signature is not None else None
    held = given.get(name)
    if held is not None and "input_ids" not in given and (encoded := _encoding(held)):
        return encoded
    if held is None or isinstance(held, (torch.Tensor, Mapping, list, tuple, str, int, float)) \
            or any(issubclass(type(given.get(n)), torch.Tensor) for n in LENGTHS):
        return {}
    lengths = next((v for n in LENGTHS if issubclass(type(v := read(held, n)), torch.Tensor) and v.dim() == 1
                    and not v.is_floating_point() and v.dtype != torch.bool), None)
    if lengths is None:
        return {}
    held = next((v for n in PAYLOADS if (v := read(held, n)) is not None), None)  # (a tensor, or a dict of them: one
    payload = next((v for v in (held.values() if isinstance(held, dict) else (held,))  # per feature, ptls's records)
                    if issubclass(type(v), torch.Tensor) and v.dim() >= 2 and v.shape[0] == lengths.shape[0]), None)
    return {} if payload is None else {name: payload, "lengths": lengths}


ENCODED = ("input_ids", "attention_mask", "token_type_ids")


def _encoding(held) -> dict:
    """{"input_ids": (B, L), and its "attention_mask", "token_type_ids" where held}: the fields of the one tokenizer's
    output (a BatchEncoding, a dict of its names) that a batch object the model call was handed holds as an attribute
    (hopsparser's BertLexerBatch, a NamedTuple of its `encoding` and the subword alignments: the batch states its
    padding, whatever the model inside is handed); {} else. Read statically, one level deep."""
    if isinstance(held, tuple) and hasattr(type(held), "_fields"):
        values = [read(held, field) for field in type(held)._fields]
    elif isinstance(held, (torch.Tensor, Mapping, list, tuple, str, int, float)):
        return {}
    else:
        values = list(getattr(held, "__dict__", {}).values())[:BATCH_FIELDS]
    encodings = [v for v in values if isinstance(v, Mapping) and issubclass(type(v.get("input_ids")), torch.Tensor)
                 and v["input_ids"].dim() == 2]
    if len(encodings) != 1:
        return {}
    return {name: encodings[0][name] for name in ENCODED if issubclass(type(encodings[0].get(name)), torch.Tensor)}

