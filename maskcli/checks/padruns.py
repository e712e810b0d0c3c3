"""padding-unmarked (checks/tokens.py's rule) where rows of one batch disagree on the run of pad ids that ends them.

The pad id is stated (tokens.py reads it) and several rows end in a run of it. The run's first token may be the EOS
that closes the text (pad == EOS, GPT-2's tokenizer: it is real), the rest of it is padding. Where the model call's
attention_mask marks that rest 0 in one row and 1 in another, the mask contradicts itself over the same tokens of the
same batch: one row's pads are kept as text, and the queries there (the pads' own outputs: log-probs, values a
trainer scores) attend them (huggingface/trl#487: `_generate_batched` kept the pads a finished sample was extended
with, and `prepare_model_inputs` gave them attention_mask 1 while the collator's right padding got 0). Under a causal
mask only the padded queries see them; the finding says so. Left alone: every row marking its run alike (a
generate loop appends ones for the pads of a finished row in every row: transformers' generate), a run of one token
(the EOS), a row whose every token is the pad id, left edges (a left-padded prompt's pads are another run).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import first_cell, real_queries
from maskcli.text import Finding


def tails(at_pad: np.ndarray) -> np.ndarray:
    """Bool (B, L): each row's run of the pad id at its end, less the run's first token (an EOS that pads)."""
    rows, length = at_pad.shape
    run = np.argmax(~at_pad[:, ::-1], axis=1)  # (length where the row is all pad: left alone by the caller)
    run = np.where(at_pad.all(axis=1), length, run)
    at = np.arange(length)[None, :]
    return at > (length - run)[:, None]


def disagreeing(top, calls, at_pad: np.ndarray, given: np.ndarray, pad_id: int, said: str) -> list:
    """padding-unmarked where the attention_mask marks the pad run ending one row padding and another's real, and a
    query sees one of the latter. `calls`: tokens.py's (call, cells, own) of the model call's attention."""
    if at_pad.all(axis=1).any():
        return []
    rest = tails(at_pad)
    masked = [b for b in range(len(rest)) if rest[b].any() and not given[b][rest[b]].any()]
    kept = rest & (given == 1)
    if not masked or not kept.any():
        return []
    length = rest.shape[1]
    for call, cells, own in calls:
        seen = cells[:, :, :length] & kept[:, None, :]
        if not seen.any():
            continue
        real_q = real_queries((given == 1) & ~rest, own)
        only = "" if (seen & real_q[:, :, None]).any() else ", padded queries only"
        b, q, k = first_cell(seen & real_q[:, :, None] if only == "" else seen)
        return [(call, Finding("padding-unmarked", (
            f"batch row {b}: query {int(own[q])} sees key {k}, a token at {said} ({pad_id}) in the run that ends the row "
            f"(past its first token, which may be an EOS that pads), which the attention_mask of {top.where} marks real, while it marks "
            f"the same run padding in batch row {masked[0]} ({int(kept.sum())} such tokens{only}): the pads a finished "
            f"sequence was extended with kept as text?"),
            expected="no query of the batch sees a padding key", source=said, cell=(b, int(own[q]), k)))]
    return []


def stated_bos(top) -> int | None:
    """The BOS id the model call's tokenizer or config states; None where neither states an integer one."""
    bos = top.arguments.get("tokenizer_bos_id", getattr(top.config, "bos_token_id", None))
    return bos if isinstance(bos, int) and not isinstance(bos, bool) else None


def at_bos(ids: np.ndarray | None, top, pad_id: int | None, shape: tuple | None = None) -> np.ndarray:
    """Bool (B, L): the ids at the BOS id the model call's tokenizer or config states (not also the pad id); a 0-d
    False where none is stated. A BOS the attention_mask marks 0 inside a row starts a later packed example, masked on
    purpose (axolotl#131's ConstantLengthDataset), not text hidden (checks/tokens.py's real-tokens-masked)."""
    bos = stated_bos(top)
    stated = bos is not None and bos != pad_id and ids is not None \
        and (shape is None or ids.shape == shape)  # (`shape`: the mask's the ids must lie over)
    return np.asarray(ids == bos) if stated else np.asarray(False)


def inside(hidden: np.ndarray, given: np.ndarray, ids: np.ndarray) -> bool:
    """A row's masked text of one id lies inside it (a token the mask marks real before it and after it): no padding
    of any side, and not the stated pad id (OpenRLHF 01b8a23d: `seq != eos & seq != pad` masks every chat turn's EOS).
    Not where they are one run right after a kept token of their id: the terminator's own copies as a filler placed by
    position, not a mask built from the ids (IndexTTS's fix pads each text with its stop token after the real one,
    kept: blind-lv). A run right before a kept copy is still said: its first masked token is the text's own terminator,
    a filler after it kept (`filler_kept`: IndexTTS's bug, the mask's ones padded onto the row's ends)."""
    real = np.flatnonzero(given == 1)
    if real.size == 0 or not hidden[real[0]:real[-1]].any():
        return False
    at = np.flatnonzero(hidden)
    if at[-1] - at[0] + 1 != at.size:
        return True  # (masked in several places: each turn's EOS)
    return not (at[0] > 0 and given[at[0] - 1] == 1 and ids[at[0] - 1] == ids[at[0]])


def filler_kept(hidden: np.ndarray, given: np.ndarray, ids: np.ndarray) -> bool:
    """A row's masked run of one id inside it, right before a kept token of that id (see `inside`)."""
    at = np.flatnonzero(hidden)
    return at.size > 0 and at[-1] - at[0] + 1 == at.size and at[-1] + 1 < len(ids) and given[at[-1] + 1] == 1 \
        and ids[at[-1] + 1] == ids[at[0]] and (at[0] == 0 or ids[at[0] - 1] != ids[at[0]])


def positioned_padding(top, given: np.ndarray, at_pad: np.ndarray) -> np.ndarray:
    """Bool (B,): rows whose masked tokens the program's own position ids call padding. The attention_mask's 0s are one
    run at the row's start and the model call's `position_ids` count only its 1s, from 0 (`attention_mask.cumsum(-1) -
    1`, the pads clamped or filled: onnxruntime's GPT-2 helper over random dummy ids, HF's generate): the positions say
    those tokens are not the text, whatever their ids. Not where the batch's ids are padded with the pad id (a run of
    two or more that the mask marks 0, or at a row's edge): the ids then state the padding themselves, and a mask that
    hides more is still said. (Random ids may hold the pad id twice in a row among the text, marked 1: no padding.)"""
    positions = top.arguments.get("position_ids")
    rows, length = given.shape
    none = np.zeros(rows, bool)
    runs = at_pad & ((given == 0) | np.cumprod(at_pad, axis=1).astype(bool) | np.cumprod(at_pad[:, ::-1], axis=1)[:, ::-1]
                     .astype(bool))  # (the pad ids that pad: masked, or in a run at either edge)
    if not isinstance(positions, np.ndarray) or positions.shape != given.shape or (runs[:, 1:] & runs[:, :-1]).any():
        return none
    ones = given == 1
    lead = np.cumprod(~ones, axis=1).astype(bool)  # (each row's run of 0s at its start)
    counted = np.where(ones, np.cumsum(ones, axis=1) - 1, positions)
    return (lead == ~ones).all(axis=1) & (counted == positions).all(axis=1) & lead.any(axis=1)


def past_the_end(top, ids: np.ndarray, given: np.ndarray) -> np.ndarray:
    """Bool (B, L): each row's run of 0s to its end right after a token at the stated EOS id (the model's config, its
    tokenizer) that the mask keeps: what a generate loop sampled past the row's end, masked on purpose, not text
    (keras-hub#1029's fix: the output padding mask cut after each row's end token, then scored)."""
    said = [top.arguments.get(n) for n in ("eos_id", "tokenizer_eos_id")] + [getattr(top.config, "eos_token_id", None)]
    eos = {e for one in said for e in (one if isinstance(one, (list, tuple)) else (one,))  # (Llama 3's config: a list)
           if isinstance(e, int) and not isinstance(e, bool)}
    rows, length = given.shape
    kept = given == 1
    last = length - 1 - np.argmax(kept[:, ::-1], axis=1)
    ended = kept.any(axis=1) & (last < length - 1) & np.isin(ids[np.arange(rows), last], list(eos))
    return ended[:, None] & (np.arange(length)[None, :] > last[:, None])


def not_text(top, ids: np.ndarray, given: np.ndarray, at_pad: np.ndarray) -> np.ndarray:
    """Bool (B, L): masked tokens the program's own statements call no text: padding by its positions
    (`positioned_padding`), or sampled past a row's end (`past_the_end`)."""
    return positioned_padding(top, given, at_pad)[:, None] | past_the_end(top, ids, given)


def bounded_inside(at_pad: np.ndarray, given: np.ndarray) -> bool:
    """The attention_mask's padding lies inside each row's pad-id run, at its far end, and the rows keep different
    numbers of the run's first pads as text: the program found the padding on its side and set where it begins by
    something else than the pads (a block of fixed size filled with pads the model learns to write: xlm-core#48's
    masked-diffusion collator keeps `prefix + BOS + block_size` slots real, so one row keeps a pad and another none).
    Not the bug padding-unmarked names: a mask made with the wrong id or side, or all ones, marks no pad of the run as
    padding, or padding elsewhere; a mask meant for another model that keeps one pad in every row (diffusers#12508:
    Chroma's "real tokens + one pad", handed to T5 too) keeps as many in each."""
    padded = [b for b in range(at_pad.shape[0]) if at_pad[b].any()]
    kept = [int((at_pad[b] & (given[b] == 1)).sum()) for b in padded]
    for b, count in zip(padded, kept):
        zeros, run = np.flatnonzero(given[b] == 0), np.flatnonzero(at_pad[b])
        if count and (zeros.size == 0 or not np.isin(zeros, run).all() or zeros[-1] - zeros[0] + 1 != zeros.size
                      or (zeros[0] != 0 and zeros[-1] != len(given[b]) - 1)):
            return False
    return len(set(kept)) > 1
