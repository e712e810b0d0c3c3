"""The samples a model call's fields state: a recommender's batch dict `model(x)` (`x["user_id"]` (B,), `x["hist"]`
(B, L)), or tensor arguments handed one by one, all of one first axis, one of them a value per sample.

A 1-D field of B values beside 2-D fields of B rows (a user id, a target item, a label, a dense feature per sample)
states that the first axis of every field is the batch: a field of one value per row has no other axis to be. Not
beside 1-D positions of the same length: positions number tokens, so those elements are a flat stream of tokens (an
engine's `input_ids` and `positions`). How
many tokens a sample's fields can make (each 1-D field one, each 2-D field its width) bounds the length of a sequence
built of them (checks/batchaxis.py reads it). Shapes only, read once per model call: nothing is copied.
"""

from __future__ import annotations

import torch

# 1-D fields that are not one value per sample: positions, slots and offsets of the tokens
NOT_SAMPLES = ("position", "pos", "slot", "cu_", "cumulative", "offset", "index", "indices")


def sample_fields(given: dict) -> dict:
    """{"sample_fields": (names, B, widths)}: the call's tensor arguments (those of one batch dict it was handed, one
    level in, too), where there are two at least, each 1-D or 2-D, all of one first axis B > 1, one at least 1-D and
    named as no position or offset is; widths: 1 for a 1-D field, its second axis for a 2-D one. Else {}."""
    fields = []
    for name, value in given.items():
        if type(value) is dict and 0 < len(value) <= 64:
            fields += [(f'{name}["{key}"]', one) for key, one in value.items()
                       if isinstance(key, str) and issubclass(type(one), torch.Tensor)]
        elif issubclass(type(value), torch.Tensor):
            fields.append((name, value))
    fields = [(name, value) for name, value in fields if value.dim() > 0]  # (a 0-d tensor: a scalar of the call)
    if len(fields) < 2 or any(value.dim() > 2 for _, value in fields):
        return {}
    samples = fields[0][1].shape[0]
    if samples < 2 or any(value.shape[0] != samples for _, value in fields):
        return {}
    if not any(value.dim() == 1 and not any(word in name.lower() for word in NOT_SAMPLES) for name, value in fields):
        return {}
    if any(value.dim() == 1 and name.lower().rstrip('"]').endswith(("position", "positions", "pos", "position_ids"))
           for name, value in fields):
        return {}  # (1-D positions of as many elements: each element is a token, a flat stream of them, not a sample:
        # an engine's `input_ids` and `positions` of every request's tokens, SGLang's and vLLM's model calls)
    widths = tuple(1 if value.dim() == 1 else int(value.shape[1]) for _, value in fields)
    return {"sample_fields": (tuple(name for name, _ in fields), int(samples), widths)}
