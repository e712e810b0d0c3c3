"""A cross-attention that sees only the memory keys its own encoder masked as padding: the memory's mask turned round.

The same model call ran a self-attention over the memory's tokens first (an encoder: square, as many batch rows and
keys as the cross-attention has keys, each real token seeing every real token of its row), whose mask hides, in some
batch row, a run of keys at one end from every real query (checks/real.read_off: the encoder's key padding, `src_tokens.eq(padding_idx)` as Uni-Mol builds it). That is the
program's own statement of which memory slots are padding. Where the cross-attention's queries of each such row, all
that attend at all, see none of the keys the encoder called real and some it called padding, its mask is that padding
read the other way round (lsh0520/3D-MoLM#8: Uni-Mol's `padding_mask`, True = padding, handed on as the Q-Former's
BERT `encoder_attention_mask`, 1 = attend: the queries of a padded molecule see its padding atoms only). Quiet where
any such query sees a real key (a mask that keeps some of the memory is another mask's business: memory.py's), where
no encoder self-attention over those keys masks padding, or where its padding is not one run at an end of each row.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.held import edge_runs
from maskcli.checks.real import read_off
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def by_row(call, rows: int) -> np.ndarray | None:
    """The call's kept cells with the heads folded (any head keeps a cell), (rows, Lq, Lk); None where unread."""
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    return np.broadcast_to(cells.any(axis=1), (rows, *cells.shape[2:]))


def _encoders(run: Run) -> dict:
    """{(id(top), rows, keys): [self-attention calls over that many keys, square, in call order]}, built once."""
    found: dict = {}
    for other in run.calls:
        rows, _, q_len, k_len = other.shape
        if q_len == k_len and other.stored is not None:
            found.setdefault((id(run.top(other)), rows, k_len), []).append(other)
    return found


def _encoder_padding(encoders: dict, read: dict, call, top, rows: int, k_len: int) -> tuple[np.ndarray, str] | None:
    """(bool (rows, k_len) real memory keys, the encoder call's site) read off the last self-attention of the same
    model call before `call` over k_len keys of the same batch rows that hides an edge padding from bidirectional
    real tokens; None where none does."""
    for other in reversed(encoders.get((id(top), rows, k_len), ())):
        if other.index >= call.index:
            continue
        key = (other.mask, other.shape)
        if key not in read:
            cells = by_row(other, rows)
            real = None if cells is None else read_off(cells, np.arange(k_len))[0]
            both = real is not None and bool((cells | ~(real[:, :, None] & real[:, None, :])).all())
            read[key] = real if both and edge_runs(real, right_only=False) else None  # (an encoder: each real token sees every real
            # token of its row; a decoder's causal self-attention over as many tokens says nothing of the memory)
        if read[key] is not None:
            return read[key], other.where
    return None


def memory_turned(run: Run) -> list:
    """Cross-attention calls whose attending queries, in every row its encoder pads, see only that padding."""
    found, done, read = [], set(), {}
    encoders = _encoders(run) if run.cross else {}
    for call in run.cross:
        top = run.top(call)
        if top is None or call.stored is None:
            continue
        rows, _, q_len, k_len = call.shape
        said = _encoder_padding(encoders, read, call, top, rows, k_len)
        if said is None:
            continue
        real, encoder = said
        key = (call.mask, call.shape, real.tobytes())
        if key in done:
            continue
        done.add(key)
        cells = by_row(call, rows)
        if cells is None:
            continue
        padded = (~real).any(axis=1)
        asking = cells.any(axis=-1) & padded[:, None]  # (queries of the padded rows that attend at all)
        sees_real = (cells & real[:, None, :]).any(axis=-1) & asking
        sees_pad = cells & ~real[:, None, :] & asking[:, :, None]
        if sees_real.any() or not sees_pad.any() or not asking.any(axis=1)[padded].all():
            continue
        b, q, k = first_cell(sees_pad)
        found.append((call, Finding("memory-padding-inverted", (
            f"batch row {b}: query {q} sees memory key {k}, which the encoder's own self-attention ({encoder}) masks as "
            f"padding, and no query of a padded row sees any key that encoder calls real ({int(sees_pad.sum())} such "
            f"cells): the memory's padding mask handed on the other way round (True = padding read as 1 = attend?)"),
            expected="decoder queries see the memory keys its encoder calls real", source=f"the mask of {encoder}",
            cell=(b, q, k))))
    return found


RULES = (
    Rule("memory-padding-inverted", "wrong", "steps", "a cross-attention whose queries see only the memory keys the "
         "same model call's encoder self-attention masked as padding, none it called real", memory_turned),
)
