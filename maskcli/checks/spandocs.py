"""A packed row's documents laid over its span block ids (checks/spans.py): a span never joins two documents.

transformers reads packed documents off a model call's `position_ids` where it is handed no attention_mask
(masking_utils.find_packed_sequence_indices: a new document wherever a position is not the one before it plus 1) and
ANDs them with every other mask, its blockwise overlay included. PaliGemma numbers every prefix token of a row block 0
(`torch.where(token_type_ids == 0, 0, -1)`), so in a packed row each document's prefix is its own span only through
that AND: a prefix token of one document never sees a later document's prefix (transformers' PaliGemma 2 packed
without padding, written as a correct program: quiet-r108a).
"""

from __future__ import annotations

import numpy as np


def by_document(top, ids: np.ndarray) -> np.ndarray:
    """The block ids (B, L), each span cut where the model call's position_ids start a new document; unchanged where
    the call was handed an attention_mask or no 2-D position_ids of the ids' shape, or its positions never restart."""
    positions = top.arguments.get("position_ids")
    if "attention_mask" in top.arguments or not isinstance(positions, np.ndarray) or positions.shape != ids.shape \
            or ids.size == 0:
        return ids
    steps = np.diff(positions, axis=1, prepend=positions[:, :1] - 1)
    documents = np.cumsum(steps != 1, axis=1)
    if not documents.any():
        return ids
    return np.where(ids >= 0, ids + documents * (int(ids.max()) + 1), -1).astype(np.int64)
