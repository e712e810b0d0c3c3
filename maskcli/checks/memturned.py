"""A cross-attention that sees only the memory keys its own encoder masked as padding: the memory's mask turned round.

The same model call (or one of its own before it that made no cross-attention: an encoder run on its own) ran a
self-attention over the memory's tokens first (an encoder: square, as many batch rows and
keys as the cross-attention has keys, each real token seeing every real token of its row), whose mask hides, in some
batch row, a run of keys at one end from every real query (checks/real.read_off: the encoder's key padding, `src_tokens.eq(padding_idx)` as Uni-Mol builds it). That is the
program's own statement of which memory slots are padding. Where the cross-attention's queries of each such row, all
that attend at all, see none of the keys the encoder called real and some it called padding, its mask is that padding
read the other way round (lsh0520/3D-MoLM#8: Uni-Mol's `padding_mask`, True = padding, handed on as the Q-Former's
BERT `encoder_attention_mask`, 1 = attend: the queries of a padded molecule see its padding atoms only). Quiet where
any such query sees a real key (a mask that keeps some of the memory is another mask's business: memory.py's), where
no encoder self-attention over those keys masks padding, or where its padding is not one run at an end of each row.
The latest encoder run over those keys is the memory's: one whose every query sees every key states no padding (a
batch of one unpadded source generated after a padded one, transformers' batched-generate tests row by row).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.held import edge_runs
from maskcli.checks.memrows import copied_rows, encoder_runs
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
    """{(rows, keys): [square self-attention calls over that many keys, in call order]}, built once per run."""
    held = run.__dict__.get("_encoders")
    if held is not None and held[0] == (id(run.calls), len(run.calls)):
        return held[1]
    found: dict = {}
    for other in run.calls:
        rows, _, q_len, k_len = other.shape
        if q_len == k_len and other.stored is not None:
            found.setdefault((rows, k_len), []).append(other)
    run.__dict__["_encoders"] = ((id(run.calls), len(run.calls)), found)
    return found


class Encoded(NamedTuple):
    """The memory's padding as its encoder's self-attention states it: `real` (bool (rows, keys)) the real keys where
    `known`, else the run of each row holding key 0 (a segment mask whose two runs say nothing of which is the
    padding); `where` the encoder call's site."""

    real: np.ndarray
    where: str
    known: bool
    copied: tuple = ()  # per row, where the rows were read by content (memrows.Copied: the output row its memory copies)


def encoder_padding(run: Run, call, read: dict | None = None, k_len: int | None = None) -> Encoded | None:
    """The padding of `call`'s memory (a cross-attention's keys) read off the last bidirectional self-attention before
    it over as many keys of the same batch rows: of the same model call, or of one that made no cross-attention (an
    encoder run on its own, before the decoder's calls), never of the cross-attention's own block (a decoder layer's
    self-attention over its own tokens). Its mask states the padding two ways: an edge run of keys hidden from every
    real query (Uni-Mol's `padding_mask`, nn.TransformerEncoder's src_key_padding_mask), or a segment mask keeping real
    with real and padding with padding (Dia's `create_attn_mask(src, src)`: its runs' lengths differing between rows,
    or the ids the encoder was handed constant on one of them, the pad id). None where no such call states one.
    `k_len`: the memory's keys where the call has more (keys of its own beside them: memturned._beside)."""
    from maskcli.checks.context import _block

    read = {} if read is None else read
    rows, k_len = call.shape[0], call.shape[3] if k_len is None else k_len
    copied = copied_rows(run, call, rows, read)  # (its rows copies of earlier outputs' rows: checks/memrows.py)
    if copied is not None:
        return _by_content(run, copied, k_len, read)
    top = run.top(call)
    crossing_tops = read.get("tops")
    if crossing_tops is None:
        crossing_tops = read["tops"] = {id(run.top(other)) for other in run.cross}
    block, batch = _block(call.where), None
    for other in _before(run, call, rows, k_len):
        mine = run.top(other)
        if mine is not top and (mine is None or id(mine) in crossing_tops) or block and _block(other.where) == block:
            continue
        if other.shape[0] != rows and mine is top:
            continue  # (a batch expanded between the encoder and the decoder is expanded by another model call)
        batch = other.shape[0] if batch is None else batch
        if other.shape[0] != batch:
            continue  # (an older encoder run over another batch: the memory is the latest encoder's, expanded)
        key = (other.mask, other.shape, id(mine))  # (its ids may say which run of a segment mask is the padding)
        if key not in read:
            read[key] = _stated(other, mine, batch, k_len)
        if read[key] is not None:
            if batch != rows and mine is not top and encoder_runs(run, mine, k_len, read) > 1:
                return None  # (several encoder runs back to back: the memory may be rows of any of them, memrows.py)
            return read[key] if batch == rows else _expanded(read[key], top, rows)
    return None


def _by_content(run: Run, copied: list, k_len: int, read: dict) -> Encoded | None:
    """The padding of each memory row read off the encoder call whose output row it copies (memrows.copied_rows):
    that call's last self-attention over `k_len` keys of its own rows (_stated). A row that copies none, or one whose
    encoder states its padding no way read here, is left all real: it is not judged by another row's encoder."""
    real, where = np.ones((len(copied), k_len), bool), None
    for at, one in enumerate(copied):
        if one is None:
            continue
        key = ("content", id(one.top), k_len)
        if key not in read:
            read[key] = _own_run(run, one.top, k_len)
        encoded = read[key]
        if encoded is not None and encoded.known and one.row < encoded.real.shape[0]:
            real[at], where = encoded.real[one.row], where or encoded.where
    return None if where is None else Encoded(real, where, True, tuple(copied))


def _own_run(run: Run, mine, k_len: int) -> Encoded | None:
    """What the latest square self-attention over `k_len` keys of one model call states of its rows' padding."""
    held = mine.arguments.get("output_rows")
    rows = len(next(iter(held.values()))) if isinstance(held, dict) and held else None
    for other in reversed(run.made_by(mine)):
        if other.shape[0] == rows and other.shape[2] == other.shape[3] == k_len and other.stored is not None:
            found = _stated(other, mine, rows, k_len)
            if found is not None:
                return found
    return None


def _before(run: Run, call, rows: int, k_len: int) -> list:
    """The square self-attentions over `k_len` keys before `call`, latest first, of its batch rows or of a batch they
    expand (a row count dividing them: generate's beam search repeats each encoder row num_beams times)."""
    found = [other for (count, keys), calls in _encoders(run).items() if keys == k_len and count and rows % count == 0
             for other in calls if other.index < call.index]
    return sorted(found, key=lambda other: other.index, reverse=True)


def _expanded(encoded: Encoded, top, rows: int) -> Encoded | None:
    """The encoder's padding over its own rows expanded to the cross-attention's `rows`: each row repeated
    (transformers' _expand_inputs_for_generation, repeat_interleave) or the batch tiled; where the two differ, the one
    the model call's own memory mask states (its encoder attention mask over those rows), else None (not known)."""
    times = rows // encoded.real.shape[0]
    each, tiled = np.repeat(encoded.real, times, axis=0), np.tile(encoded.real, (times, 1))
    if np.array_equal(each, tiled):
        return encoded._replace(real=each)
    arguments = {} if top is None else top.arguments
    for name in ("encoder_attention_mask", "attention_mask"):
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and given.shape == each.shape:
            return next((encoded._replace(real=one) for one in (each, tiled) if np.array_equal(given != 0, one)), None)
    return None


def _stated(other, top, rows: int, k_len: int) -> Encoded | None:
    """What one self-attention call's mask states of its keys' padding (encoder_padding), or None."""
    cells = by_row(other, rows)
    if cells is None:
        return None
    if cells.all():  # (every query sees every key: the latest encoder run states no padding, not to be passed over
        return Encoded(np.ones((rows, k_len), bool), other.where, True)  # for an older run of other inputs)
    real = read_off(cells, np.arange(k_len))[0]
    seen = cells.any(axis=1)  # (a key no query of its row sees is padding too where no other row sees it either, which
    real = real & seen  # read_off cannot tell: a source padded to an engine's static length, one row or every row)
    if bool((cells | ~(real[:, :, None] & real[:, None, :])).all()) and edge_runs(real, right_only=False):
        return Encoded(real, other.where, True)  # (an encoder: each real token sees every real token of its row; a
        # decoder's causal self-attention over as many tokens says nothing of the memory)
    head = _segments(cells)
    if head is None:
        return None
    side = _pad_side(top, head)
    if side is not None:
        return Encoded(head if side == "tail" else ~head, other.where, True)
    lengths = head.sum(axis=1)
    if len(set(lengths[lengths < k_len].tolist())) > 1 or (lengths == k_len).any():
        return Encoded(head, other.where, False)  # (runs of one length in every row: fixed chunks, not padding)
    return None


def _segments(cells: np.ndarray) -> np.ndarray | None:
    """Bool (rows, keys): each row's run holding key 0, where every row's cells keep exactly one run [0, s) with
    itself and the rest [s, L) with itself (s = L: an unpadded row), some row split; else None."""
    k_len = cells.shape[2]
    if cells.shape[1] != k_len:
        return None
    count = cells[:, 0, :].sum(axis=1)
    head = np.arange(k_len)[None, :] < count[:, None]
    if count.min() < 1 or (count == k_len).all():
        return None
    if not np.array_equal(cells, head[:, :, None] == head[:, None, :]):
        return None
    return head


def _pad_side(top, head: np.ndarray) -> str | None:
    """"tail" or "head": the run the encoder's own ids (its model call's input ids) fill with one id in every split
    row, the other run holding some other id; None where neither or both do, or no ids of that shape were handed."""
    arguments = {} if top is None else top.arguments
    ids = next((arguments[n] for n in ("input_ids", "idx", "tokens", "src") if isinstance(arguments.get(n), np.ndarray)),
               arguments["first_ids"][1] if isinstance(arguments.get("first_ids"), tuple) else None)
    if not isinstance(ids, np.ndarray) or ids.shape != head.shape:
        return None
    split = ~head.all(axis=1)
    sides = []
    for name, pad in (("tail", ~head), ("head", head)):
        cells = ids[split][pad[split]]
        if cells.size and (cells == cells[0]).all() and (ids[split][~pad[split]] != cells[0]).any():
            sides.append(name)
    return sides[0] if len(sides) == 1 else None


def memory_turned(run: Run) -> list:
    """Cross-attention calls whose attending queries, in every row its encoder pads, see only that padding."""
    found, done, read = [], set(), {}
    for call in run.cross:
        top = run.top(call)
        if top is None or call.stored is None:
            continue
        rows, _, q_len, k_len = call.shape
        cells = by_row(call, rows)
        if cells is None:
            continue
        said, offset = encoder_padding(run, call, read), 0
        if said is None:
            said, offset = _beside(run, call, cells, read)
        if said is None or not said.known:
            continue
        real, encoder = said.real, said.where
        key = (call.mask, call.shape, real.tobytes(), offset)
        if key in done:
            continue
        done.add(key)
        sees_pad = _turned(cells[:, :, offset:offset + real.shape[1]], real)
        if sees_pad is None:
            continue
        b, q, k = first_cell(sees_pad)
        extra = k_len - real.shape[1]
        beside = (f"; {extra} key{'s' if extra > 1 else ''} of the attention's own {'before' if offset else 'after'} "
                  f"the memory's left out") if extra else ""
        found.append((call, Finding("memory-padding-inverted", (
            f"batch row {b}: query {q} sees memory key {k + offset}, which the encoder's own self-attention ({encoder}) "
            f"masks as padding, and no query of a padded row sees any key that encoder calls real ({int(sees_pad.sum())} "
            f"such cells{beside}): the memory's padding mask handed on the other way round (True = padding read as 1 = "
            f"attend?)"),
            expected="decoder queries see the memory keys its encoder calls real", source=f"the mask of {encoder}",
            cell=(b, q, k + offset))))
    return found


def _turned(cells: np.ndarray, real: np.ndarray) -> np.ndarray | None:
    """The (rows, Lq, Lk) cells where queries of padded rows see padding, where every padded row's queries that attend
    any of these keys see none its encoder calls real and some see padding; else None."""
    padded = (~real).any(axis=1)
    asking = cells.any(axis=-1) & padded[:, None]  # (queries of the padded rows that attend at all)
    sees_real = (cells & real[:, None, :]).any(axis=-1) & asking
    sees_pad = cells & ~real[:, None, :] & asking[:, :, None]
    if sees_real.any() or not sees_pad.any() or not asking.any(axis=1)[padded].all():
        return None
    return sees_pad


def own_key_ends(run: Run, call, planes: list, read: dict, fits):
    """(Encoded, keys, ends) for each count of keys an encoder attends (the largest first) that `fits(keys, Lk)` the
    call's Lk keys, and whose padding that encoder states: `ends` the offsets of its keys among the call's (0: the
    attention's own keys after them; Lk - keys: before them) where every query that attends sees the own keys, in each
    of `planes` (bool (rows, Lq, Lk): the call's cells, and those of other calls of its site)."""
    k_len = planes[0].shape[2]
    for keys in sorted({keys for _, keys in _encoders(run) if 2 <= keys < k_len and fits(keys, k_len)}, reverse=True):
        said = encoder_padding(run, call, read, keys)
        if said is None or not said.known:
            continue
        ends = [offset for offset in (0, k_len - keys) if all(
            (plane[:, :, np.r_[0:offset, offset + keys:k_len]].all(axis=-1) | ~plane.any(axis=-1)).all()
            for plane in planes)]
        yield said, keys, ends


def _beside(run: Run, call, cells: np.ndarray, read: dict) -> tuple:
    """(Encoded, offset): the memory's padding where the call's keys are an encoder's keys and a few of the attention's
    own at one end, every query that attends seeing those (a learned null key prepended, muse-maskgit's `null_kv`;
    memory tokens appended), at the one end where that reading is a turned mask and the other is no correct one (a
    mask whose queries see only keys the encoder calls real); (None, 0) where none or both read so."""
    for said, keys, ends in own_key_ends(run, call, [cells], read, lambda keys, k_len: k_len <= keys + 16):
        verdicts = {}
        for offset in ends:
            sub = cells[:, :, offset:offset + keys]
            verdicts[offset] = ("right" if not (sub & ~said.real[:, None, :]).any() else
                                "turned" if _turned(sub, said.real) is not None else "other")
        turned = [offset for offset, verdict in verdicts.items() if verdict == "turned"]
        if len(turned) == 1 and "right" not in verdicts.values():
            return said, turned[0]
    return None, 0


RULES = (
    Rule("memory-padding-inverted", "wrong", "steps", "a cross-attention whose queries see only the memory keys the "
         "same model call's encoder self-attention masked as padding, none it called real", memory_turned),
)
