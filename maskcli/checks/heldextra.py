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

from maskcli.checks.context import Run, cross, real_queries
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


def handed_elsewhere(run: Run, call, held: dict) -> bool:
    """Another self-attention of the run, over another number of keys than `call`, is handed this very padding: each of
    its real queries sees exactly the real keys (or, causal, only real keys, a left pad hidden: _kept_in_order), the
    padding's w tokens being all its keys or its last or first w. The
    padding is those tokens', handed on: not `call`'s over a few more keys (ACT's VAE encoder handed key_padding_mask
    over [cls, state, actions], held while ACT's encoder runs over latent, state and image features), nor, where it
    lies within that call's longer sequence, `call`'s of w keys (its action_is_pad, there the last 8 of 10, held while
    the decoder's learned action queries attend each other: the actions' padding is the loss's, not the queries')."""
    table = held["rows"]
    if held["kind"] not in ("keep", "pad") or table.ndim != 2 or table.shape[0] < 2:
        return False
    real, width, k_len = (table if held["kind"] == "keep" else ~table), table.shape[1], call.shape[3]
    if real.all() or not real.any(axis=1).all() or k_len < width:
        return False  # (fewer keys: the padding folded into the batch in chunks, heldfold.py, the same tokens)
    done = run.__dict__.setdefault("_handed", {})
    key = (real.tobytes(), real.shape, k_len)
    if key not in done:  # (another number of keys, w or a few more: _handed_to)
        done[key] = any(_handed_to(other, real) for other in run.calls
                        if other.shape[3] != k_len and other.shape[2] == other.shape[3] and not cross(other))
    return done[key]


def _handed_to(other, real: np.ndarray) -> bool:
    from maskcli.checks.context import keep

    rows, width, k_len = real.shape[0], real.shape[1], other.shape[3]
    if other.shape[0] != rows or k_len < width or k_len > width + 2 * EXTRA_KEYS:
        return False
    cells = keep(other)
    if cells is None or cells.shape[0] not in (1, rows):
        return False
    cells = np.broadcast_to(cells.all(axis=1), (rows, k_len, k_len))
    extra = np.ones((rows, k_len - width), dtype=bool)
    placed = [real] if k_len == width else [np.concatenate([extra, real], axis=1), np.concatenate([real, extra], axis=1)]
    for keys in placed:
        sees = cells[keys]  # (each real query's row of keys)
        expected = np.repeat(keys, keys.sum(axis=1), axis=0)
        if np.array_equal(sees, expected) or _kept_in_order(cells, keys):
            return True
    return False


def _kept_in_order(cells: np.ndarray, keys: np.ndarray) -> bool:
    """A causal (or any narrower) self-attention handed the padding: no real query sees a padded key, each sees one,
    and some real query sees a key after a padded key of its row that it does not see (left padding hidden on purpose;
    causal order alone, which hides right padding from every real query, says nothing of who was handed it)."""
    real_q = keys[:, :, None]  # (rows, q, 1): the queries are the keys' own positions
    if (cells & real_q & ~keys[:, None, :]).any() or not (cells.any(axis=2) | ~keys).all():
        return False
    seen = cells & real_q
    last = np.where(seen.any(axis=2), seen.shape[2] - 1 - np.argmax(seen[:, :, ::-1], axis=2), -1)  # (rows, q)
    first_pad = np.where((~keys).any(axis=1), np.argmax(~keys, axis=1), keys.shape[1])  # (rows,)
    return bool((last > first_pad[:, None]).any())


def stated_instead(run: Run, call, cells: np.ndarray, own) -> np.ndarray | None:
    """Bool (rows, Lk): the padding the model call itself states over exactly `call`'s keys (its attention_mask, its
    lengths: real.stated), some of them padding, where the kernel's mask keeps to it (no real query sees a key it calls
    padding); else None. A mask held up the stack that says otherwise is another sequence's of as many tokens, not the
    one this call was to keep to (TRL's DPO batch: `chosen_attention_mask` over 12 tokens, held while generate's step
    over the 12 keys of a prompt and its first tokens runs with the prompt's own mask)."""
    from maskcli.checks.real import stated

    rows, k_len = call.shape[0], call.shape[3]
    said = stated(run.top(call), rows, k_len)
    if said is None or not said[2] or said[0].all() or own is None:
        return None
    real = np.broadcast_to(said[0], (rows, k_len))
    return None if (cells & real_queries(real, own)[:, :, None] & ~real[:, None, :]).any() else real

