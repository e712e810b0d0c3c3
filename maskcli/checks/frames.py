"""An encoder over fewer frames than its input's samples, masking frames of a sample the model call says is unpadded.

A speech or vision encoder is handed its raw input (`input_values`, `input_features`: no token ids) with an
`attention_mask` over that input's S samples, and attends over the L < S frames its convolutions make of them: the
program reduces the mask to the frames itself (Wav2Vec2's `_get_feature_vector_attention_mask`, HuBERT's, Whisper's
and SpeechT5's). Whatever the reduction, a sample the mask calls wholly real (the longest one: no padding at all)
makes frames that are all real, so a self-attention whose mask is that reduction (key padding, the same keys for
every query of a row) may hide none of that row's frames. Hiding some says the reduction counts the lengths of
another stage (transformers#16725: the frame lengths divided by the adapter's strides too, for the encoder that runs
before the adapter), or reads the lengths off the wrong axis.

Stays quiet where the mask is not that reduction: a causal or windowed mask (a decoder's, whose own padding is not the
input's), a cross-attention, a batch folded with other rows, a model call given token ids (its mask is over the
text, and an image tower's patches have their own padding), and a mask over the S samples themselves.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import TOKENS
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _unpadded_rows(mask) -> np.ndarray | None:
    """Bool (B,): the rows of a 2-D 0/1 padding mask (1 = real) with no padding, where it is a padded batch's (each
    row one run of real samples at one edge, some row padded, some not); None otherwise."""
    if not isinstance(mask, np.ndarray) or mask.ndim != 2 or mask.shape[0] < 2 or not np.isin(mask, (0, 1)).all():
        return None
    real = mask.astype(bool)
    count = real.sum(axis=1)
    if count.min() < 1 or count.max() != real.shape[1] or count.min() == real.shape[1]:
        return None
    at = np.arange(real.shape[1])[None, :]
    right = (real == (at < count[:, None])).all(axis=1)
    left = (real == (at >= real.shape[1] - count[:, None])).all(axis=1)
    return count == real.shape[1] if (right | left).all() else None


def _key_padding(cells: np.ndarray) -> np.ndarray | None:
    """Bool (B, Lk): the keys each row's queries see, where every query of the row that sees a key sees the same ones
    (a key-padding mask, bidirectional); None where any row is causal, windowed or otherwise shaped."""
    seen = []
    for row in cells:
        live = row[row.any(axis=1)]
        if len(live) == 0 or not (live == live[0]).all():
            return None
        seen.append(live[0])
    return np.array(seen)


def real_frames_masked(run: Run) -> list:
    """Self-attention calls over fewer keys than the model call's input samples whose key padding hides frames of a
    row that the model call's attention_mask calls unpadded."""
    found, done = [], {}
    for call in run.calls:
        top = run.top(call)
        if top is None or any(name in top.arguments for name in TOKENS) or call.stored is None:
            continue
        unpadded = _unpadded_rows(top.arguments.get("attention_mask"))
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if unpadded is None or rows != len(unpadded) or q_len != k_len or k_len >= len(top.arguments["attention_mask"][0]):
            continue
        key = (call.mask, call.shape, id(top))
        if key not in done:
            done[key] = _finding(call, top, unpadded)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, top, unpadded: np.ndarray) -> Finding | None:
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, len(unpadded)):
        return None
    cells = np.broadcast_to(cells.any(axis=1), (len(unpadded), call.shape[2], call.shape[3]))
    seen = _key_padding(cells)
    if seen is None:
        return None
    hidden = unpadded[:, None] & ~seen
    if not hidden.any():
        return None
    b = int(np.argwhere(hidden.any(axis=1))[0][0])
    keys = [int(k) for k in np.flatnonzero(hidden[b])]
    samples = top.arguments["attention_mask"].shape[1]
    source = f"attention_mask of {top.where}"
    return Finding("real-frames-masked", (
        f"batch row {b} has no padding in the model call's attention_mask ({samples} input positions, all real), yet this "
        f"attention over the {call.shape[3]} frames made of them hides frames {spans(keys)} from every query "
        f"({len(keys)} of {call.shape[3]}): the frame lengths were counted for another stage (an adapter's or a "
        f"decoder's downsampling) or off the wrong axis?"),
        expected=f"every frame of batch row {b} real", source=source, cell=(b, 0, keys[0]))


RULES = (
    Rule("real-frames-masked", "wrong", "call", "an encoder over fewer frames than its input's samples whose key padding "
         "hides frames of a sample the model call's attention_mask calls unpadded (frame lengths counted for another "
         "stage: Wav2Vec2's adapter strides)", real_frames_masked),
)
