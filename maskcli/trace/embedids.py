"""A model call handed its tokens as embeddings (`inputs_embeds`, no ids): each token's vector read as one id, so that
the same vectors handed to another call of the model are the same tokens (checks/runalone.py: the program runs the
same sequence, each token real, in a call of its own). Two tokens share an id where their vectors are the same bits
(a hash of them; equal vectors, equal ids). Read only where a call is handed a float (B, L, D) input by one of these
names and no ids; the program's values are read, never changed, and its random state is not touched."""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.padded import MOST  # (elements of one argument kept: the ids' (B, L))

EMBEDS = ("inputs_embeds", "input_embeds", "embeds", "embeddings")
_CELLS = 1 << 22  # (B, L, D) elements hashed at most (32 MB of int64 made once): a larger input is not read
_WEIGHTS: dict = {}


def hash_weights(width: int) -> np.ndarray:
    """A fixed odd int64 weight per dimension, so that `(rows * weights).sum(-1)` hashes int64 rows (int64 wraps: equal
    rows, equal hashes); its own generator: the program's random state is left alone (trace/keyscale.py hashes too)."""
    if width not in _WEIGHTS:
        rng = np.random.default_rng(width)
        _WEIGHTS[width] = rng.integers(1, 1 << 40, size=width, dtype=np.int64) * 2 + 1
    return _WEIGHTS[width]


def embed_ids(given: dict, found: dict) -> dict:
    """{"embeds_ids": int64 (B, L)}: one id per token of the call's embeddings, where it was handed no ids."""
    if any(name in found for name in ("input_ids", "idx", "tokens", "first_ids")):
        return {}
    value = next((given[n] for n in EMBEDS if isinstance(given.get(n), torch.Tensor)), None)
    if value is None or value.dim() != 3 or not value.is_floating_point() or value.device.type == "meta" \
            or value.shape[0] * value.shape[1] > MOST or value.numel() > _CELLS or value.shape[1] < 2:
        return {}
    with torch.no_grad():
        bits = value.detach().to("cpu", torch.float32).contiguous().view(torch.int32).to(torch.int64)
        ids = (bits * torch.from_numpy(hash_weights(bits.shape[-1]))).sum(-1)  # (int64 wraps: a hash, equal bits give equal ids)
    return {"embeds_ids": ids.numpy()}


def float_mask(given: dict, found: dict) -> dict:
    """{"float_attention_mask": int64 (B, L)}: an attention_mask handed as floats of 0 and 1 only (`torch.ones(...)`,
    which transformers reads as the integer one), kept apart from the integer ones the other rules read."""
    value = given.get("attention_mask")
    if "attention_mask" in found or not isinstance(value, torch.Tensor) or value.dim() != 2 \
            or not value.is_floating_point() or value.numel() > MOST or value.device.type == "meta":
        return {}
    values = value.detach().cpu()
    if not bool(((values == 0) | (values == 1)).all()):
        return {}
    return {"float_attention_mask": values.to(torch.int64).numpy()}
