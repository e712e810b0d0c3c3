"""The image prefix a config says is seen both ways at prefill, up to its end-of-image token (Surya's `unmask_image`).

Surya's OCR model (surya/common/surya/__init__.py, SuryaModel.forward) states with its config's `unmask_image=True`
that, in prefill, every token sees every key up to and including the row's end-of-image token (`eoi_token_id`):
create_eoi_mask's `arange(L) <= eoi_index`, its padding (`pad_token_id`) left out, or-ed onto the causal mask. The
image tiles before the EOI token are then one bidirectional span, the text after it causal: a prefix span as
PaliGemma's, placed by the model call's input ids. checks/spans.py judges it as it judges a family's token types: an
image query that does not see a later key of its prefix contradicts the config (VikParuchuri/surya 2791d60: with SDPA
and an unpadded batch the decoder's mask came back None, the unmasking was skipped and SDPA ran is_causal=True over
the image), and a text query that sees a later key leaks. Read where a config the program keeps states both fields
(trace/stated.py, checks/intent.py keeps eoi_token_id beside unmask_image) and the model call was handed input ids
that hold the EOI token; a row without one has no span. A decode step's ids (its new token) cover no earlier query and
are not judged (spans.py).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.intent import intent


def stated(top) -> bool:
    """A config of this model call states `unmask_image=True` with an int `eoi_token_id` (cheap: the run's gate)."""
    return any(one.fields.get("unmask_image") is True and _token(one.fields.get("eoi_token_id")) is not None
               for one in getattr(top, "stated", ()) or ())


def _token(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prefix(run, call, top) -> tuple[str, np.ndarray] | None:
    """(what states it, block ids (B, L): 0 from each row's start through its first EOI token, -1 after it and in a
    row without one) for `call`, where its configs state unmask_image=True and eoi_token_id and the model call's input
    ids (B, L), or (L,) for a batch of one, hold that token; None elsewhere."""
    said = intent(run, call)
    eoi = _token(said.values.get("eoi_token_id"))
    if said.values.get("unmask_image") is not True or eoi is None:
        return None
    ids = top.arguments.get("input_ids")
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and call.shape[0] == 1:
        ids = ids[None, :]
    if not isinstance(ids, np.ndarray) or ids.ndim != 2:
        return None
    at = ids == eoi
    if not at.any():
        return None
    first = np.where(at.any(axis=1), at.argmax(axis=1), -1)[:, None]  # (B, 1): the row's first EOI, -1 for none
    blocks = np.where(np.arange(ids.shape[1])[None, :] <= first, 0, -1).astype(np.int64)
    source = said.sources.get("unmask_image", "")
    return f"input_ids up to eoi_token_id={eoi} with unmask_image=True ({source})", blocks
