"""A BOS the attention_mask marks padding, where the pad id the program states is the BOS id.

A tokenizer with no pad token of its own is often given its BOS as the pad (`tokenizer.pad_token =
tokenizer.bos_token`, GritLM's and LLM2Vec's Llama / Mistral tokenizers); a mask then built from the ids, `input_ids
!= pad_token_id`, marks every row's BOS as padding too, and the attention hides the row's first token from its text
(lm-sys/FastChat 0f8692b2: GritLM's embeddings were pooled with the BOS masked out of the two-way attention; the fix
sets `attention_mask[:, 0] = 1` where pad == BOS). Read on the model call: its config or tokenizer states a BOS id
equal to the pad id (checks/tokens.py's pad id), every row begins with exactly one token at that id, followed by
tokens the mask marks real, the mask marks that first token 0 in every row, and the batch is padded on the right (a
row's tail a run at the pad id, marked 0): the token a row begins with is its BOS, no padding. Wrong where the
attention hides it from a real query after it. Quiet where the mask keeps the BOS (the fix), on a left-padded batch
(its rows begin with runs of pad ids of their own lengths), where no BOS id is stated or it is not the pad id, and on
a decoder whose start token is the pad id (checks/tokens.py leaves those to the config's `decoder_start_token_id`).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep, queries
from maskcli.checks.real import by_row
from maskcli.checks.padruns import stated_bos
from maskcli.checks.registry import Rule
from maskcli.checks.tokens import _ids, _pad, _start_token
from maskcli.text import Finding


def _masked_bos(run: Run, top) -> tuple[np.ndarray, int, str] | None:
    """(the attention_mask (B, L), the BOS = pad id, where the pad id is said) where every row's first token is the
    BOS the mask marks padding in a right-padded batch; None elsewhere."""
    arguments = top.arguments
    ids, given, said = _ids(arguments), arguments.get("attention_mask"), _pad(arguments)
    if ids is None or said is None or not isinstance(given, np.ndarray) or given.shape != ids.shape or ids.ndim != 2 \
            or ids.shape[1] < 3 or stated_bos(top) != said[0]:
        return None
    pad_id = said[0]
    at_pad = ids == pad_id
    lead = np.cumprod(at_pad, axis=1).sum(axis=1)
    if not (lead == 1).all() or not ((given == 0) | (given == 1)).all() or (given[:, 0] != 0).any() \
            or (given[:, 1] != 1).any() or _start_token(run, top, at_pad, pad_id):
        return None
    tail = np.cumprod(at_pad[:, ::-1], axis=1).sum(axis=1)
    columns = np.arange(ids.shape[1])[None, :]
    right = (tail > 0) & (tail < ids.shape[1] - 1)
    padded = (columns >= ids.shape[1] - tail[:, None])[:, 1:]  # (each row's tail at the pad id, past its BOS)
    if not right.any() or not ((given[:, 1:] == 0) == padded)[right].all():
        return None  # (no row padded on the right, marked so: the first token may be padding after all)
    return given, pad_id, said[1]


def bos_masked(run: Run) -> list:
    """Model calls whose attention hides each row's BOS, marked padding because the pad id is the BOS id."""
    found = []
    for top in run.tops:
        got = _masked_bos(run, top)
        if got is None:
            continue
        given, pad_id, said = got
        rows, length = given.shape
        for call in run.made_by(top):
            if call.shape[0] not in (1, rows) or call.shape[3] != length or call.stored is None:
                continue
            cells = keep(call)
            if cells is None:
                continue
            own = queries(call, top)
            real = given[:, own.clip(0, length - 1)] == 1  # (the row's text, after its BOS)
            hidden = ~by_row(cells, rows)[:, :, 0] & real & (own >= 1)[None, :]
            if not hidden.any():
                continue
            b, q = (int(x) for x in np.argwhere(hidden)[0])
            found.append((call, Finding("bos-masked", (
                f"batch row {b}: query {int(own[q])} does not see key 0, the row's BOS (id {pad_id}), which the "
                f"attention_mask of {top.where} marks padding: {said} is the BOS id too, so a mask built as "
                f"`ids != pad_id` hides every row's first token ({rows} rows, padded on the right); keep the BOS "
                f"(`attention_mask[:, 0] = 1`) or give the tokenizer a pad token of its own"),
                expected="each row's BOS seen by the row's real queries", source=said, cell=(b, int(own[q]), 0))))
            break
    return found


RULES = (
    Rule("bos-masked", "wrong", "steps", "every row's BOS marked padding by an attention_mask built from the ids, where "
         "the pad id the program states is the BOS id (a right-padded batch), and hidden from the row's real queries",
         bos_masked),
)
