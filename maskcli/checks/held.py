"""The padding the program holds at an attention call, against the mask the kernel applied.

A function of the program on the stack when attention runs holds this batch's padding (trace/held.py): a mask named as
one (`attention_mask`, `mask`, `input_mask`: 1 = a real token; `*padding_mask`, `*pad_mask`, `*is_pad`: True = padding)
or the batch's lengths (`lengths`, `*_lens`; SpeechBrain's relative `wav_lens`, each row's share of the padded length,
read right-padded, a key within one of the share's end given the benefit of the doubt). Where the kernel's mask lets a
real query see a key that padding calls padding, the mask was built and never handed on (uniem#23: the pad mask for
pooling only; SpeechBrain#1107: memory lengths never reaching a cross-attention; OpenTau#254: padded temporal frames).

What is read as padding, so that a mask meant otherwise (a loss mask, a masked-LM's choice) is not: each row one run of
real tokens at one edge, every row with a real token, and one row with no padding at all (the longest sample); a plain
`mask` only right-padded (the loss mask of a prompt is zeros at the start); a mask named as padding may also be images'
padded pixels, flattened (heldfold.image_padding: detrex's ConditionalSelfAttention took DETR's and never used it). Where
it cannot say which way the program's padding lies along the keys (lengths: right- or left-padded) or along a batch
folded with other rows (`b * n` rows: repeat_interleave or repeat), it speaks only where every reading is seen through:
a program whose mask keeps to its padding one way is quiet. Several held paddings: quiet where any is kept to.

Where every query of each padded row sees exactly the keys such a mask calls padding and no real one, the mask was
turned round on its way (padding-only-attended: torch_brain#74's bias filled where the keep-mask is True); no row need
be whole there, as the exact complement is the statement.

Also held: 2-D positions restarting at 0 (held-documents-leak, torchtitan#3130's packing loop); cells: heldcells.py.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.arguments import counts_on, document_starts, padded_positions
from maskcli.checks.context import Run, columns_are_positions, cross, first_cell, keep, queries, real_queries
from maskcli.checks.heldextra import EXTRA_KEYS, beside_extra, handed_elsewhere, seen_both_ways, stated_instead
from maskcli.checks.heldfold import beyond_batch, folded_padding, handed_batch, image_padding, over_memory, padded_batch as _padding, rows_of
from maskcli.checks.heldkeys import keys_of
from maskcli.checks.heldlengths import by_lengths
from maskcli.checks.heldscript import script_padding
from maskcli.checks.heldzero import named_other_way, own_called_padding, zeroed_as_real
from maskcli.checks.ragged import one_at_a_time
from maskcli.checks.registry import Rule
from maskcli.checks.tiled import batch_part
from maskcli.text import Finding


def readings(held: dict, rows: int, length: int, ids: tuple = ()) -> list[np.ndarray]:
    """Bool (rows, length) real keys, one per way `held` may lie over the call's `rows` batch rows and `length` keys;
    [] where it is not padding of this call. `ids`: the token ids (B, L) the frames hold beside it (_at_one_id)."""
    found = held["rows"]
    if held["kind"] in ("cells", "positions", "ids", "columns"):
        return []
    if held["kind"] == "relative":  # right-padded; a key within one of share * length may be real either way it rounds
        if found.size < 2 or length < 4:
            return []
        tables = [np.arange(length)[None, :] < np.ceil(found * length)[:, None] + 1]
    elif held["kind"] == "lengths":
        if found.size == 0 or found.max() != length or found.min() < 1 or found.min() == length:
            return []
        at = np.arange(length)[None, :]
        tables = [at < found[:, None], at >= length - found[:, None]]
    else:
        if found.ndim != 2 or found.shape[1] != length:
            return []
        real = found if held["kind"] == "keep" else ~found
        if not _padding(real[:, :held.get("over_cache", length)], right_only=held["name"] == "mask") \
                and not _at_one_id(real, ids) and not (held["kind"] == "pad" and image_padding(real)):  # (a cache: heldkeys.py)
            return []
        tables = [real]
    size = tables[0].shape[0]
    if rows == size or size == 1:
        return [np.broadcast_to(t, (rows, length)) for t in tables]
    if size > 1 and rows % size == 0:  # a batch folded with n other rows each (patches, heads): either way round
        n = rows // size
        return [t[np.arange(rows) // n] for t in tables] + [t[np.arange(rows) % size] for t in tables]
    return []


def _at_one_id(real: np.ndarray, ids: tuple) -> bool:
    """Each row a run of real tokens at one edge, each with one, rows of different lengths, and token ids held beside
    it equal to one id exactly where it says padding and nowhere else: the data's own padding (DeepSpeed-Chat's collator pads its
    prompts on the left to a fixed length, so no row is whole, and names its prompt mask plain `mask`), where a loss
    mask over a prompt would hide tokens of many ids."""
    count = real.sum(axis=1)
    if real.shape[0] < 2 or count.min() < 1 or count.min() == count.max():
        return False  # (as many zeros in every row: a span of one id each row has, an image's placeholders, not padding)
    at = np.arange(real.shape[1])[None, :]
    if not ((real == (at < count[:, None])).all(axis=1) | (real == (at >= real.shape[1] - count[:, None])).all(axis=1)).all():
        return False
    for tokens in ids:
        if tokens.shape == real.shape:
            pad = np.unique(tokens[~real])
            if len(pad) == 1 and not (tokens[real] == pad[0]).any():
                return True
    return False


def pair_rows(held: dict, rows: int, length: int, ids: tuple = ()) -> list[np.ndarray | None]:
    """Bool (rows,) per table of readings(): where the batch is folded with as many rows each as the keys (`b * n`
    rows, n the keys' length: axial attention over a pair map, AlphaFold's (b i) j), whether each row's own token is
    real; None for a table of no such fold. A row of a padded token is a padded pair (i, j) for every j, which no key
    mask need keep to (a finite fill over the whole row, its max subtracted, reads as seeing every key)."""
    tables = readings(held, rows, length, ids)  # (the same tables as the caller's: `ids` as it hands readings)
    size = held["rows"].shape[0] if held["rows"].ndim == 2 else 0
    if not tables or size < 2 or rows != size * length:
        return [None] * len(tables)
    at = np.arange(rows)
    half = len(tables) // 2  # (readings: the folds by repeat_interleave first, then those by repeat)
    out = []
    for index, table in enumerate(tables):
        base = table[:: length] if index < half else table[:size]  # (rows of one batch element each way round)
        out.append(base[at // length, at % length] if index < half else base[at % size, at // size])
    return out


def _wider_pairs(helds: list[dict], rows: int, length: int) -> set[int]:
    """Ids of held (rows, length) padding masks over a pair map's rows (`b * n` rows, n the keys' length) that call real,
    in a row of a real token, a key that another held (b, length) padding of the batch calls padding, every way round
    the fold may be read: a pair mask built wider than both its tokens' padding (alphafold2 dda22b5: `mask_i + mask_j`
    on bools is OR), which the kernel keeping to does not make the batch's padding kept."""
    masks = [held for held in helds if held["kind"] in ("keep", "pad") and held["rows"].ndim == 2
             and held["rows"].shape[1] == length]
    wider = set()
    for inner in masks:
        if inner["rows"].shape[0] != rows:
            continue
        called = inner["rows"] if inner["kind"] == "keep" else ~inner["rows"]
        for outer in masks:
            if outer is inner or outer["rows"].shape[0] * length != rows or outer["rows"].shape[0] < 2:
                continue
            pairs = list(zip(readings(outer, rows, length), pair_rows(outer, rows, length)))
            if pairs and all(row_real is not None and (called & row_real[:, None] & ~real).any()
                             for real, row_real in pairs):
                wider.add(id(inner))
    return wider


def _tracks_keys(run: Run, call, held: dict) -> bool:
    """Whether a held padding may be of this call's keys: where the call's site began with another number of keys (a
    decoder's self-attention over its growing cache), only if a padding of that name was as long as the keys there too.
    (A seq2seq generate holds the source's attention_mask all along: Marian's 7 source tokens meet the decoder's
    self-attention at its 7th target token by their number alone.)"""
    first = (run.sites().get(call.where) or [call])[0]
    if first is call or first.shape[3] == call.shape[3] or held.get("over_cache") == first.shape[3]:
        return True  # (a prompt's padding laid over the cache: as wide as the site's first call, heldkeys.py)
    return any(h["name"] == held["name"] and _length(h) == first.shape[3] for h in first.details.get("held_padding") or ())


def _per_sequence(run: Run, call, held: dict) -> bool:
    """Held lengths the call's site runs over one sequence at a time (checks/ragged.py): its calls holding lengths of
    that name and values have each length's keys (SGLang's CPU extend kernel, one softmax per request)."""
    found, top = held["rows"], run.top(call)  # (within one model call: the program's own run of one row alone, later,
    return held["kind"] == "lengths" and one_at_a_time(run, call, found, lambda one: run.top(one) is top and any(
        h["kind"] == "lengths" and h["name"] == held["name"] and np.array_equal(h["rows"], found)  # is no loop)
        for h in one.details.get("held_padding") or ()), key=(id(top), held["name"], found.tobytes()))


def _length(held: dict) -> int | None:
    """How many keys a held padding covers: its mask's width, or its longest length."""
    found = held["rows"]
    if held["kind"] == "lengths":
        return int(found.max()) if found.size else None
    return int(found.shape[-1]) if held["kind"] in ("keep", "pad") and found.ndim == 2 else None


def _seen(cells: np.ndarray, real: np.ndarray, own: np.ndarray | None) -> np.ndarray:
    """Bool (rows, Lq, Lk): real queries (all queries of a cross-attention: `own` None) that see a padding key."""
    rows, q_len, length = cells.shape
    real_q = np.ones((rows, q_len), dtype=bool) if own is None else real_queries(real, own)
    sees_real = (cells & real[:, None, :]).any(axis=2)  # (a row that sees no real key is a padding row, unmasked)
    return cells & (real_q & sees_real)[:, :, None] & ~real[:, None, :]


def _told(picks: list) -> tuple[dict, np.ndarray]:
    """(held, bad cells) of the reading a finding names: one held outright (a mask, read one way only) before one of
    several (lengths, read right- and left-padded: beside a left-padded `is_pad`, is_pad's)."""
    count, _, held, bad = min(picks, key=lambda pick: pick[0] > 1)
    return held, bad


def held_padding(run: Run) -> list:
    """Calls whose real queries see keys every reading of every padding the program holds there calls padding."""
    found, done = [], {}
    square = [call for call in run.unmasked if call.shape[2] == call.shape[3] > 1]  # (and an sdpa handed no mask at
    # all: Flux's T5 encoder, its tokenizer's attention_mask never passed, black-forest-labs/flux#507)
    # (a softmax that masks nothing over the memory its layer was handed (`context`, `memory`: heldfold.over_memory) is
    # attention too, not a router's: OpenNMT's global attention, its context_lengths never passed)
    handed = [call for call in run.unmasked if call.api == "softmax" and not call.shape[2] == call.shape[3] > 1
              and over_memory(call)]
    for call in [*run.calls, *run.cross, *square, *handed]:  # (a softmax that masks nothing: its mask may be the one never handed on)
        helds = keys_of(run, call, square, readings)  # (a key mask expanded over the cells read; the memory's padding left out)
        helds = [*(helds or ()), *script_padding(call, _at_one_id)]  # (a script's own mask the ids agree with: heldscript.py)
        if not helds or call.stored is None or batch_part(call):
            continue  # (a chunk of a larger batch: the padding held for the batch is not its rows', tiled.py)
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds), cross(call))
        if key in done:
            if done[key] is not None:
                found.append((call, done[key]))
            continue
        done[key] = None
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, rows):
            continue
        cells = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
        own = None if cross(call) or q_len < k_len else queries(call, run.top(call))
        # (fewer queries than keys: a decoder's over its memory or a step over its cache; each query is judged, but
        # where the model call states where they sit in the keys (a static cache's cache_position), on its own token)
        placed = None if own is not None or cross(call) else _stated_places(call, run.top(call))
        if own is None and q_len == k_len:
            continue  # a cross-attention with as many queries as keys: the padding may be its queries' own (a decoder's
            # lengths), which no key mask need keep to: a reading seen through
        seen_through, picks = True, []
        ids = tuple(h["rows"] for h in helds if h["kind"] == "ids")
        wider = _wider_pairs(helds, rows, k_len)
        batch = handed_batch(run, call)
        for held in helds:
            if id(held) in wider or batch is not None and rows_of(held) == rows or beyond_batch(run, call, held):
                continue  # (a pair mask wider than its batch's padding; another batch's: heldfold.handed_batch)
            tables = readings(held, rows, k_len, ids) if _tracks_keys(run, call, held) \
                and not _per_sequence(run, call, held) else []
            pairs = pair_rows(held, rows, k_len, ids) if tables else []
            if not tables:  # (a sequence's padding over a call that folds it into the batch in chunks: heldfold.py)
                tables = [real for one, real in folded_padding(call, [held]) if one is held] \
                    or beside_extra(run, call, held)  # (or over a few more keys: a CLS or state token's, heldextra.py)
                pairs = [None] * len(tables)
            for real, row_real in zip(tables, pairs):
                bad = _seen(cells, real, own)
                if placed is not None:  # (a query on a padding token: its row is unmasked on purpose, _unmask_unattended)
                    bad = bad & real_queries(real, placed)[:, :, None]
                elif own is None and q_len < k_len and not cross(call):  # (a step's queries, the last keys: on padding,
                    bad = bad & real[:, k_len - q_len:][:, :, None]  # a finished row's next pads: XLM's generate)
                if row_real is not None:
                    bad = bad & row_real[:, None, None]
                if not bad.any():
                    seen_through = False
                    break
                picks.append((len(tables), real, held, bad))
            if not seen_through:
                break
        picks = [pick for pick in picks if not handed_elsewhere(run, call, pick[2])]  # (another call's tokens')
        said = None if not picks or cross(call) else stated_instead(  # (the call's own word, kept to)
            run, call, cells, own if own is not None else placed if placed is not None else queries(call, run.top(call)))
        picks = [pick for pick in picks if said is None or np.array_equal(said, pick[1])]
        if not picks or not seen_through:
            continue
        held, bad = _told(picks)
        b, q, k = first_cell(seen_both_ways(picks, held, bad))
        what = {"keep": "a padding mask (1 = real)", "pad": "a padding mask (True = padding)", "lengths": "the batch's lengths",
                "relative": "the batch's relative lengths (each row's share of the padded length)"}[held["kind"]]
        said = f"{held['name']} in {held['where']}"
        if held["kind"] in ("keep", "pad") and held["rows"].shape[-1] > k_len:  # (heldfold.py's chunks)
            what += f" of {held['rows'].shape[-1]} positions, folded into the batch in chunks of {k_len},"
        elif held["kind"] in ("keep", "pad") and held["rows"].shape[-1] < k_len or held.get("over_cache"):  # (heldextra's;
            what += f" of its prompt's {held['over_cache']} tokens, the first" if held.get("over_cache") else \
                f" of {held['rows'].shape[-1]} tokens, the last or the first"  # a prompt's over its cache: heldkeys.py)
        at = own if own is not None else placed
        query = f"query {q}" if at is None else f"query {int(at[q])}"
        done[key] = Finding("padding-unused", (
            f"batch row {b}: {query} sees key {k}, which the program's own padding calls padding: {said} is {what} of "
            f"these {k_len} keys, held by a function that made this call, and the mask handed to the kernel does not "
            f"keep to it ({int(bad.sum())} such cells) — " + (
                "the pair mask handed down is wider than both its tokens' padding (OR where AND was meant?)" if wider
                else "built and never handed on?")),
            expected="no real query sees a key the program's padding calls padding", source=said, cell=(b, q, k))
        found.append((call, done[key]))
    return found


def _stated_places(call, top) -> np.ndarray | None:
    """The key position of each of the call's queries where the model call states it (`cache_position`, `input_pos`:
    a static cache's slot j is position j), else None (a memory's keys, or a cache that says nothing)."""
    arguments = {} if top is None else top.arguments
    return queries(call, top) if any(isinstance(arguments.get(name), np.ndarray) and arguments[name].shape[-1:] == (
        call.shape[2],) for name in ("cache_position", "input_pos")) and columns_are_positions(call, top) else None


def held_documents(run: Run) -> list:
    """A query that sees another document's key, the documents marked by positions the program holds at the call that
    restart at 0 inside a row (a packing loop's `positions`, never handed to the model call: arguments.py reads those
    that are), or by the documents' lengths a batch dict holds (heldlengths.py)."""
    found, done = [], {}
    for call in run.calls:
        helds = [held for held in call.details.get("held_padding") or () if held["kind"] == "positions"]
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        top = run.top(call)
        if not helds or call.stored is None or q_len != k_len or top is not None and "position_ids" in top.arguments:
            continue
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = None
            cells = keep(call)
            for held in helds:
                positions = held["rows"]
                if cells is None or cells.shape[0] not in (1, rows) or positions.shape[1] != k_len \
                        or positions.shape[0] not in (1, rows):
                    continue
                labels = np.broadcast_to(np.where(counts_on(positions), document_starts(positions, None), 0), (rows, k_len))
                padded = np.broadcast_to(padded_positions(positions), (rows, k_len))
                seen = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
                across = seen & (labels[:, :, None] != labels[:, None, :]) & ~padded[:, :, None]
                if across.any():
                    b, q, k = first_cell(across)
                    said = f"{held['name']} in {held['where']}"
                    done[key] = Finding("held-documents-leak", (
                        f"{said} restart at 0 (packed documents) but query {q} of batch row {b} sees key {k} of another "
                        f"document ({int(across.sum())} such cells): the mask does not restart with them"),
                        expected="a document mask from the positions", source=said, cell=(b, q, k))
                    break
        if done[key] is not None:
            found.append((call, done[key]))
    return found + by_lengths(run)  # (documents by the lengths a batch dict holds: heldlengths.py)


def edge_runs(real: np.ndarray, right_only: bool) -> bool:
    """Each row a run of real tokens at one edge with at least one real token, some row padded (no row need be whole:
    a batch padded to a bucket)."""
    count = real.sum(axis=1)
    if count.min() < 1 or count.min() == real.shape[1]:
        return False
    at = np.arange(real.shape[1])[None, :]
    right = (real == (at < count[:, None])).all(axis=1)
    left = (real == (at >= real.shape[1] - count[:, None])).all(axis=1)
    return bool(right.all() or not right_only and (left.all() or (right | left).all()))


def after_every_query(call, run: Run, real: np.ndarray, at: int) -> bool:
    """Every key the mask calls real, in each padded row, lies after every query of a self-attention (a decode step
    at position i whose `padding_mask` is True on 0 .. i, Keras's way round: read as torch's, its "real" keys are the
    unwritten future, which the call never shows whichever way the mask is meant)."""
    if cross(call) or not real.any(axis=1).all():
        return False
    own = queries(call, run.top(call))
    first = np.argmax(real, axis=1) + at
    return bool(len(own) and (first > own.max()).all())


def held_inverted(run: Run) -> list:
    """Calls whose every query, in every padded batch row, sees exactly the keys a padding mask the program holds calls
    padding, and none it calls real: the mask turned round on its way to the kernel (torch_brain#74)."""
    found, done = [], {}
    for call in [*run.calls, *run.cross]:
        helds = [held for held in call.details.get("held_padding") or () if held["kind"] in ("keep", "pad")]
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if not helds or call.stored is None:
            continue
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = None
            cells = keep(call)
            if cells is not None and cells.shape[0] in (1, rows):
                cells = np.broadcast_to(cells, (rows, *cells.shape[1:]))
                for held in helds:
                    table = held["rows"]
                    if table.ndim != 2 or table.shape[0] != rows or not 0 <= k_len - table.shape[1] <= EXTRA_KEYS:
                        continue
                    real = table if held["kind"] == "keep" else ~table
                    if not edge_runs(real, right_only=held["name"] == "mask"):
                        continue
                    padded = ~real.all(axis=1)
                    # keys the padding does not cover (a relay, CLS or register token put before or after the tokens):
                    # its keys are the call's last ones or its first ones, and the complement must hold over them
                    # (the keys beside them are seen, as a relay or CLS token is: a cache's unwritten slots past the
                    # tokens, which no query sees, are no such keys and the tokens are not read as the call's last ones)
                    extra = k_len - table.shape[1]
                    for at in sorted({extra, 0}, reverse=True):
                        over = cells[padded][..., at:at + table.shape[1]]
                        beside = np.delete(cells[padded], np.arange(at, at + table.shape[1]), axis=-1)
                        if (over == ~real[padded][:, None, None, :]).all() and beside.all():
                            break
                    else:
                        continue
                    if after_every_query(call, run, real[padded], at) or zeroed_as_real(call, real, padded, at) \
                            or own_called_padding(run, call, real, padded, at) or named_other_way(run, held):
                        continue  # (the complement is then causality itself: it says nothing of which way round; or
                        # those it calls real the program zeroed in K, or names real; or a decode's own token padding)
                    b = int(np.flatnonzero(padded)[0])
                    k = int(np.flatnonzero(~real[b])[0]) + at
                    said = f"{held['name']} in {held['where']}"
                    beside = f" (keys {at}-{at + table.shape[1] - 1} of {k_len}: its tokens)" if extra else ""
                    done[key] = Finding("padding-only-attended", (
                        f"every query of each padded batch row sees exactly the keys {said} calls padding{beside} and "
                        f"none it calls real (batch row {b}: keys {(np.flatnonzero(~real[b]) + at).tolist()} only): "
                        f"the padding mask was turned round on its way to the kernel (filled where it is True, or "
                        f"read as True = masked)"), expected=f"the real keys of {held['name']}", source=said,
                        cell=(b, 0, k))
                    break
        if done[key] is not None:
            found.append((call, done[key]))
    return found


RULES = (
    Rule("padding-only-attended", "wrong", "call", "every query of each padded row sees exactly the keys a padding mask "
         "the program's own frames hold calls padding, and no real key: the mask turned round (filled where True)",
         held_inverted),
    Rule("padding-unused", "wrong", "call", "a real query that sees a key the batch's padding held by the program's own "
         "frames (a padding mask or lengths, built and never handed on) calls padding, every way it may be read",
         held_padding),
    Rule("held-documents-leak", "wrong", "call", "a query that sees another packed document's key, the documents marked "
         "by positions the program's own frames hold at the call restarting at 0 (never handed to the model call) or "
         "by the documents' lengths a batch dict holds (batch[\"seq_lengths\"])",
         held_documents),
)
