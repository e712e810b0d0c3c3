"""A padding the program holds over the tokens of a self-attention whose keys hold a few more (checks/held.py reads it).

A model that puts a few tokens of its own beside the batch's padded ones (a CLS token, a robot state, registers, a
readout) attends over more keys than the padding mask its batch holds covers: LeRobot's ACT VAE encoder runs over
[cls, robot_state, *action_chunk] while `batch["action_is_pad"]` covers the action chunk alone (lerobot#279). Such a
(B, w) mask over a self-attention of w < L <= w + EXTRA_KEYS keys is read as the padding of its last w keys or of its
first w (the tokens put before them or after them), the keys besides them real; padding-unused speaks only where both
readings are seen through. Read only where the mask is a padded batch (each row one run of real tokens at one edge,
one row whole: heldfold.padded_batch) and no cross-attention of the run has w keys (a memory's padding held beside a
decoder's self-attention is not of its keys), nor does another model call state the same mask as its own attention mask
(a generate loop's decoder mask, held while it runs the encoder over frames: Whisper's, transformers PR #48028).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross
from maskcli.checks.heldfold import padded_batch

EXTRA_KEYS = 4  # keys besides the tokens a held padding covers (a relay node, CLS, registers) that it may leave out


def beside_extra(run: Run, call, held: dict) -> list[np.ndarray]:
    """Bool (rows, L) real keys of a held (B, w) padding mask over the last w or the first w of a self-attention's L
    keys (w < L <= w + EXTRA_KEYS), the others real; [] where it is not read so."""
    table = held["rows"]
    rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
    if held["kind"] not in ("keep", "pad") or table.ndim != 2 or table.shape[0] != rows \
            or not 0 < k_len - table.shape[1] <= EXTRA_KEYS or q_len != k_len or cross(call):
        return []
    real = table if held["kind"] == "keep" else ~table
    if not padded_batch(real, right_only=False) \
            or any(other.shape[3] == table.shape[1] for other in run.cross) \
            or _stated_by_another(run, call, real):  # (a memory's padding, perhaps; another model call's tokens')
        return []
    extra = np.ones((rows, k_len - table.shape[1]), dtype=bool)
    return [np.concatenate([extra, real], axis=1), np.concatenate([real, extra], axis=1)]


def _stated_by_another(run: Run, call, real: np.ndarray) -> bool:
    """Another model call of the run states this very padding as its own attention mask over its w tokens (a decoder's
    `decoder_attention_mask`, held by a generate loop that runs the encoder first over frames of its own): the mask is
    that call's, not this call's tokens beside a few of the model's."""
    top = run.top(call)
    for other in run.tops:
        if other is top:
            continue
        for name in ("attention_mask", "decoder_attention_mask"):
            given = other.arguments.get(name)
            if isinstance(given, np.ndarray) and given.shape == real.shape and np.array_equal(given != 0, real):
                return True
    return False


def seen_both_ways(picks: list, held: dict, bad: np.ndarray) -> np.ndarray:
    """The cells bad under every reading of `held` among padding-unused's picks (count, real, held, bad), where it was
    read over a few more keys and some are (the cell named is then padding whichever end the tokens lie at); else
    `bad`."""
    both = [one for _, _, other, one in picks if other is held]
    if held["kind"] not in ("keep", "pad") or held["rows"].ndim != 2 or len(both) < 2 \
            or held["rows"].shape[1] == bad.shape[-1]:
        return bad
    common = np.logical_and.reduce(both)
    return common if common.any() else bad
