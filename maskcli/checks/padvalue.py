"""An attention_mask padded with the pad id: its values above 1 lie exactly on the tokens that are the pad id.

A collator that pads every field with one `padding_value` (the tokenizer's pad id) pads the attention_mask with it too:
its rows read 1 on the tokens and, say, 2 on the padding (TRL#885: DPO's collator padded `*_attention_mask` with the
pad id 2, fixed to pad masks with 0). A model reads any nonzero value as a token to attend (transformers turns the mask
to bool), so the padding is attended. Where the values above 1 are one value that lies only on tokens equal to
the pad id the model call states (its config's `pad_token_id`, its embedding's `padding_idx`, its tokenizer's), in one
run at an edge of each row and not in every row (a real token may be the pad id too: an EOS that is the pad id), the
program's mask says which tokens are padding: the 1s are the
tokens (checks/real.py reads it so), and those values are not packed samples' numbers (numbered.py) nor Longformer's
global marks (globaltokens.py).
"""

from __future__ import annotations

import numpy as np

TOKENS = ("input_ids", "idx", "tokens")


def padded_with_id(arguments: dict) -> int | None:
    """The pad id the model call's attention_mask was padded with; None where it was not (a 0/1 mask, numbers that
    are not where the pad id is)."""
    mask = arguments.get("attention_mask")
    if not isinstance(mask, np.ndarray) or mask.ndim != 2 or mask.dtype.kind not in "iu" or not mask.size \
            or mask.min() < 0 or mask.max() < 2:
        return None
    above = mask > 1
    value = int(mask.max())
    if not (mask[above] == value).all() or (mask == 1).sum() == 0:
        return None
    tokens = next((arguments[n] for n in TOKENS if isinstance(arguments.get(n), np.ndarray)), None)
    pad_id = arguments.get("pad_id", arguments.get("tokenizer_pad_id"))
    if tokens is None or tokens.shape != mask.shape or pad_id != value:
        return None
    if not (tokens[above] == pad_id).all() or above.all(axis=1).any() or (~above).all():
        return None
    for row in above:  # one run at the start or at the end of each row
        at = np.flatnonzero(row)
        if at.size and not (at[0] == 0 or at[-1] == len(row) - 1) or at.size and at[-1] - at[0] + 1 != at.size:
            return None
    return value
