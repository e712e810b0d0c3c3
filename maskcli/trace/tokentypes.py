"""A `segment_ids` argument that is BERT's token types, not packed documents: ParlAI's BertWrapper, UniLM and many BERT
ports name token_type_ids so, and the model says which it is by embedding them. Where the called module holds a
token-type embedding (`token_type_embeddings`, a segment embedding) that has a row for every value of the argument,
it is kept as the call's token_type_ids (checks/varlen.py reads segment_ids as documents: a cross-encoder's context and
candidate segments attend each other, as BERT's always do)."""

from __future__ import annotations

import weakref

import numpy as np
import torch

WORDS = ("token_type", "segment_emb", "seg_emb", "type_emb")  # an embedding's name that says it embeds token types
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> rows of its token-type embedding (0: none)


def _rows(module) -> int:
    """The rows of the widest token-type embedding the module holds, read once a module (its named_modules walked)."""
    try:
        return _HELD[module]
    except (KeyError, TypeError):
        pass
    rows = 0
    try:
        for name, sub in module.named_modules():
            if isinstance(sub, torch.nn.Embedding) and any(word in name.lower() for word in WORDS):
                rows = max(rows, int(sub.num_embeddings))
        _HELD[module] = rows
    except (TypeError, AttributeError, RuntimeError):  # (a module whose children are not modules' own)
        return 0
    return rows


def token_types(module, found: dict) -> dict:
    """`found` with a direct segment_ids argument kept as token_type_ids where the module embeds them as token types."""
    segments = found.get("segment_ids")
    if not isinstance(segments, np.ndarray) or not segments.size or "token_type_ids" in found \
            or "segments_held_by" in found or "segments_named" in found or not isinstance(module, torch.nn.Module):
        return found
    rows = _rows(module)
    if rows and int(segments.min()) >= 0 and int(segments.max()) < rows:
        found = dict(found)
        found["token_type_ids"] = found.pop("segment_ids")
    return found
