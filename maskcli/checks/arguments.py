"""What the mask should be, read from the model call's own arguments: its attention_mask and its position_ids.

`attention_mask` (B, L), 1 = a real token, as Hugging Face models and BERT take it: no real query
may see a padding key, at any step and in any layer the call reaches, prefill and decode alike
(generate hands the whole mask, cached tokens included, to each step). `position_ids` that restart
at 0 inside a row mark packed documents (transformers' find_packed_sequence_indices, masking_utils.py):
no query may see another document's keys. Keys are read where the key columns are positions (a cache
that keeps every key from position 0); an encoder-decoder's attention_mask (or its input ids at the pad id, where
it is handed no mask) is its encoder's, so it is read on its encoder's self-attention only (by module path; its
cross-attention is memory.py's). The packed-batch rules of `pack` are in packing.py.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, beside_memory, cross, first_cell, keep, queries, real_queries
from maskcli.checks.heldpad import held_readings
from maskcli.checks.ragged import one_at_a_time
from maskcli.checks.real import kept_turned, stated, stated_once
from maskcli.checks.towers import in_tower
from maskcli.checks.permuted import reordered
from maskcli.checks.registry import Rule
from maskcli.checks.tiled import batch_part, chunk_readings
from maskcli.text import Finding


def _cells_by_row(call, rows: int):
    """The call's keep cells (rows, Lq, Lk) over its heads, batch rows broadcast; None where they do not fit."""
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, rows) or call.shape[0] != rows:
        return None
    return np.broadcast_to(cells.any(axis=1), (rows, *cells.shape[2:]))


def folded(top, rows: int, length: int) -> tuple[list, str, bool] | None:
    """([bool (rows, length) real tokens, one per way round], source, sure): the model call's stated padding of B rows
    where the call's `rows` are B folded with its heads (TF's `tf.concat(tf.split(Q, h, axis=2), axis=0)`, head-major:
    row r is sample r % B; a `view(B * h, ...)`, batch-major: r // h); None where no B < rows states it."""
    for size in range(2, rows // 2 + 1):
        if rows % size == 0:
            said = stated(top, size, length)
            if said is not None:
                real, source, sure = said
                at = np.arange(rows)
                return [real[at % size], real[at // (rows // size)]], source, sure
    return None


def _heads_first(call) -> bool:
    """The call's folded scores came of a (H, B, ..) query viewed H * B rows, head-major (row n is sample n % B): its
    outer axis is the module's stated head count and the inner one is not (KoSpeech's `q.permute(2, 0, 1, 3)
    .contiguous().view(B * H, L, D)`); trace/scores.py's details["fold"] says only which axis was outer."""
    fold = call.details.get("fold")
    return isinstance(fold, (list, tuple)) and len(fold) == 2 and fold[0] == call.details.get("stated_heads") != fold[1]


def _batch_major(call, top, rows: int, length: int) -> np.ndarray | None:
    """Bool (rows, length): the model call's stated padding of its B rows laid on the call's B * H rows as its scores
    were: batch-major (row n is sample n // H) where they were made from a (B, H, ..) query viewed so (trace/scores.py's
    details["fold"]: `q.view(B * H, L, D)`), head-major (n % B) where from a (H, B, ..) one (_heads_first); None where
    that layout is not known (either way round is read then)."""
    fold = call.details.get("fold")
    if not isinstance(fold, (list, tuple)) or len(fold) != 2 or fold[0] * fold[1] != rows:
        return None
    if _heads_first(call):
        said = stated(top, fold[1], length)
        return None if said is None else said[0][np.arange(rows) % fold[1]]
    said = stated(top, fold[0], length)
    return None if said is None else said[0][np.arange(rows) // fold[1]]


def _fold_words(call, top, rows: int, length: int, b: int = 0) -> str:
    """How a finding says the call's rows fold the model call's batch (`folded`): with its heads only where the call has
    no heads axis of its own and the module's head count is the fold (TF's concat of split heads); else with as many
    rows of another axis (AlphaFold 3's templates and pair rows, its heads an axis of their own)."""
    if batch_part(call):
        start, total = call.details["tile"][0]
        size = chunk_readings(call, top, length)[3]
        if size == total:  # (a call over some of the batch's own rows: a loop handing the kernel one sample at a time)
            return f" of this call, sample {start + b} of the batch of {size} (attended apart from the others)"
        return (f" (of the chunk at rows {start}..{start + rows - 1} of the {total} that fold the batch of {size} with "
                f"{total // size} rows each, either way round)")
    size = next((n for n in range(2, rows // 2 + 1) if rows % n == 0 and stated(top, n, length) is not None), rows)
    each = rows // size
    if _batch_major(call, top, rows, length) is not None:
        order = "head-major" if _heads_first(call) else "batch-major"
        return f" (of the batch of {size} folded with its {each} heads {order}, as its scores were laid out)"
    if call.shape[1] == 1 and call.details.get("stated_heads") == each:
        return f" (of the batch of {size} folded with its {each} heads, either way round)"
    return f" (of the batch of {size} folded with {each} rows of another axis each, either way round)"


def over_stated_padding(call, run: Run) -> bool:
    """An eager softmax over 4-D scores (B, H, Lq, Lk), or 3-D ones (B or B * H, Lq, Lk), whose keys are the model call's
    stated tokens, some of them padding: attention over those tokens though it masks nowhere (a mask dropped on a path:
    BertGeneration's use_cache, transformers#35043; keys masked by a test that never holds: Kyubyong/transformer#69),
    where a softmax that masks nowhere is otherwise not read (a router's is over experts)."""
    if call.api != "softmax" or len(getattr(call, "q", ()) or ()) < 3:
        return False
    top = run.top(call)
    if top is None or not top.arguments or _decoder_of_source(run, top):
        return False
    said = stated(top, call.shape[0], call.shape[3])
    if said is None:
        fold = folded(top, call.shape[0], call.shape[3])
        said = None if fold is None else (fold[0][0], *fold[1:])
    return said is not None and said[2] and not said[0].all() and call.shape[3] > 1


def _decoder_of_source(run: Run, top) -> bool:
    """The model call's only ids are source ids (`src_tokens`, `src`: real.SOURCE) and it makes a cross-attention: an
    encoder-decoder, whose decoder's self-attention is over other tokens than those ids (fairseq's `prev_output_tokens`)."""
    from maskcli.checks.real import SOURCE, TOKENS

    arguments = top.arguments
    return any(n in arguments for n in SOURCE) and not any(n in arguments for n in (*TOKENS, "first_ids")) \
        and any(run.top(other) is top for other in run.cross)


def _encoder_side(call) -> bool:
    """A self-attention of an encoder-decoder's encoder, by its module path (`model.encoder.layers.0.self_attn`): the
    keys the model call's attention_mask / input ids are of."""
    from maskcli.checks.sides import encoder_path

    return encoder_path(getattr(call, "where", "")) and not cross(call)


def _seen_padding(cells: np.ndarray, real: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Bool (rows, Lq, length): real queries (placed at `own`) that see a key `real` calls padding."""
    length = real.shape[1]
    return cells[:, :, :length] & real_queries(real, own)[:, :, None] & ~real[:, None, :]


def _prefill_of_slots(call, top, rows: int, k_len: int):
    """The stated padding of a prefill that writes a cache's first slots (its `cache_position` / `input_pos` 0 .. L - 1,
    L the token ids' length) over more key slots than it has tokens (a static cache of max_seq_len slots, torchtune's
    `causal_mask[None, input_pos]`): its tokens are keys 0 .. L - 1 (the slots past them are unwritten)."""
    ids = next((top.arguments[n] for n in ("input_ids", "idx", "tokens") if isinstance(top.arguments.get(n), np.ndarray)),
               None)
    if ids is None or ids.ndim != 2 or not 1 < ids.shape[1] < k_len or ids.shape[1] != call.shape[2]:
        return None
    if not any(isinstance(top.arguments.get(n), np.ndarray) for n in ("cache_position", "input_pos")):
        return None
    if not np.array_equal(queries(call, top), np.arange(ids.shape[1])):
        return None
    return stated(top, rows, ids.shape[1])


def padding(run: Run) -> list:
    """Real queries that see a key the model call states is padding (its attention_mask, a key padding mask, lengths,
    or its input ids at the pad id: checks/real.py), whichever way round the mask handed to the kernel was built."""
    found, done, statements, decoders, read = [], set(), {}, {}, {}
    for call in run.calls:
        top = run.top(call)
        if top is None or call.stored is None or not top.arguments or call.details.get("hf_part"):
            continue  # (a ring's block of HF's queries or keys: its keys may be another rank's tokens, capture.py)
        if id(top) not in decoders:
            decoders[id(top)] = _decoder_of_source(run, top)
        if decoders[id(top)]:
            continue
        _, own, positions = run.placed(call)
        if getattr(top.config, "is_encoder_decoder", False) and not _encoder_side(call) or not positions:
            continue  # (an encoder-decoder's padding is its encoder's: read on its encoder's own layers only)
        rows, k_len = call.shape[0], call.shape[3]
        key = (id(top), rows, k_len, id(own), str(call.details.get("tile")))  # (own: placed's, one array for the calls
        # placed alike; a chunk of the batch: its place, tiled.py)
        if key not in read:  # (every layer of one model call reads the same statement: read once)
            read[key] = _statement(statements, call, top, rows, k_len)
        said, placed, both = read[key]
        if said is None or text_of(said) and in_tower(call):
            continue  # (keys that are not the stated tokens: a prompt prepended inside the model, CPM-Ant's; a media
            # encoder's frames, whatever their count, are not the text's attention_mask or ids: Qwen2-Audio's tower)
        readings, laid = None, None
        if both:
            readings, source, sure = said
            laid = _batch_major(call, top, rows, k_len)  # (its scores' rows laid out so: trace/scores.py)
            if laid is not None:
                readings = [laid]
            said = (readings[0], source, sure)
        real, source, sure = said
        real = reordered(top, call, real)  # (the tokens sorted inside the call before it: their padding with them)
        length = real.shape[1]
        if one_at_a_time(run, call, real.sum(axis=1), lambda one: run.top(one) is top, key=id(top)):
            continue  # (the model call's lengths of a ragged batch its site attends one sequence at a time: no padding)
        key = (call.mask, call.shape, real.tobytes(), real.shape, own.tobytes())
        if key in done:
            continue
        done.add(key)
        if beside_memory(run, call, real):
            continue  # (the padding of a cross-attention's memory, this call over its queries: a Perceiver's latents)
        cells = _cells_by_row(call, rows)
        if cells is None:
            continue
        bad = _seen_padding(cells, real, own)
        if readings is not None and not all(_seen_padding(cells, other, own).any() for other in readings[1:]):
            continue  # (folded one way, or the ids placed one way, the mask keeps to the padding: quiet)
        if placed is not None:  # (the cell named: one that every placement of the ids calls padding, where one is)
            every = np.logical_and.reduce([_seen_padding(cells, other, own) for other in readings])
            bad = every if every.any() else bad
        if bad.any() and readings is None and kept_turned(source, real, cells, own):
            continue  # (a `padding_mask` True on the tokens, Keras's way round, kept to exactly: real.kept_turned)
        if bad.any():
            b, q, k = first_cell(bad)
            step = "a decode step" if call.shape[2] == 1 and call.step > 0 else f"step {call.step}"
            # (real keys before the query, its own left out: XLNet's query stream never sees its own token, and a
            # mask that hides only that is two-stream attention, not a padding mask the wrong way round)
            at = np.arange(length)[None, None, :] - np.minimum(own, length)[None, :, None]  # (each key's offset)
            judged, seen = real_queries(real, own)[:, :, None] & real[:, None, :], cells[:, :, :length]
            hidden = 0 if call.details.get("scores_hide") else int((~seen & judged & (at < 0)).sum())
            # (real keys its own scores zero hide none); no earlier real key seen, later ones seen: a causal mask .t()
            later = not (seen & judged & (at < 0)).any() and (seen & judged & (at > 0)).any()
            turned = f"; it hides {hidden} real key{'' if hidden == 1 else 's'}: " + (
                f"another sample's padding on these heads, {_misrepeated(call)} was meant?" if laid is not None
                else "every one before its query: a causal mask transposed?" if later
                else "a padding mask the wrong way round?") if hidden else _outweighed(call)
            said_by = source if source.startswith("input ids") else "the " + source.replace(" of ", " given to ", 1)
            found.append((call, Finding("padding-ignored", (
                f"batch row {b}{'' if readings is None else placed if placed is not None else _fold_words(call, top, rows, length, b)}: "
                f"query {int(own[q])} sees key {k}, which {said_by} "
                f"{'mark' if source.split(' ')[0].endswith('s') else 'marks'} as padding ({step}; {int(bad.sum())} such "
                f"cells{turned})" + ("" if sure else f" (if token id {top.arguments.get('pad_id')} is padding there)")),
                None if sure else "suspicious", expected="no real query sees a padding key", source=source,
                cell=(b, int(own[q]), k))))
    return found


def _statement(statements: dict, call, top, rows: int, k_len: int) -> tuple:
    """(said, placed, both) of padding(): the model call's statement of the call's keys, (real (rows, Lk), source, sure),
    with both=False; else its readings folded with the heads or held beside it ([readings], source, sure), both=True,
    `placed` saying how the ids were placed where held; (None, None, False) where it states none."""
    if batch_part(call):  # (a chunk of the batch folded with its heads: both ways round, at its place, tiled.py)
        said = chunk_readings(call, top, k_len)
        return (None, None, False) if said is None else (said[:3], None, True)
    given = top.arguments.get("attention_mask")
    said = stated_once(statements, top, rows, k_len)
    if said is None and isinstance(given, np.ndarray) and given.ndim == 2 and "cache_position" in top.arguments \
            and k_len > given.shape[1]:  # a static cache's slots past the mask (cache.py's)
        said = stated(top, rows, given.shape[1])
    if said is None:
        said = _prefill_of_slots(call, top, rows, k_len)
    if said is not None:
        return said, None, False
    said = folded(top, rows, k_len)  # (the batch folded with its heads: read both ways round)
    if said is not None:
        return said, None, True
    said = held_readings(top, rows, k_len)  # (ids held in a batch dict, a key or two of the model's own beside)
    return (None, None, False) if said is None else (said[:3], said[3], True)


def _misrepeated(call) -> str:
    """How a mask laid the other way round than its folded scores was likely repeated."""
    return "a batch-major repeat (repeat_interleave, unsqueeze(1).repeat) where a head-major repeat(H, 1, 1)" if _heads_first(call) \
        else "a repeat where repeat_interleave"


def text_of(said: tuple) -> bool:
    """The statement `padding` read (said, placed, both) is the model call's text's: its attention_mask or input ids."""
    source = said[1] if len(said) == 3 and isinstance(said[1], str) else ""
    return source.startswith(("attention_mask", "input ids"))


def _outweighed(call) -> str:
    """Where the scores' own values hide cells (trace/finitefill.py): an additive mask they outweigh."""
    value = call.details.get("scores_hide")
    return "" if not value else (f"; the scores reach {value:.3g} in magnitude, so the additive mask lowers a "
                                 "padded key less than the scores differ: mask with finfo(dtype).min")


def document_starts(position_ids: np.ndarray, real: np.ndarray | None) -> np.ndarray:
    """Int64 (B, L): each token's document number, a new one where the position restarts at 0 after a real token.
    `real` is the model call's attention_mask: 0 = padding, any other value a real token (a multipack collator writes
    each packed sample's number there, 1, 1, 2, 2, 2, 3: axolotl's multipack collator). A row whose positions go down
    anywhere but to 0 between real tokens (4, 3, 2, 1, 0: a sequence laid backwards), or jumps up by more than one into
    positions that count on (3, 0, 1, 2, 4, 5: one sentence's positions shuffled, ConSERT's augmentation), packs no
    documents: none read."""
    restart = np.zeros(position_ids.shape, dtype=bool)
    restart[:, 1:] = (position_ids[:, 1:] == 0) & (position_ids[:, :-1] >= 0)
    down = (position_ids[:, 1:] < position_ids[:, :-1]) & (position_ids[:, 1:] != 0)
    down[:, :-1] |= (position_ids[:, 1:-1] > position_ids[:, :-2] + 1) & (position_ids[:, 2:] == position_ids[:, 1:-1] + 1)
    if real is not None:
        both = (real[:, 1:] != 0) & (real[:, :-1] != 0)
        restart[:, 1:] &= both
        down &= both
    restart &= ~down.any(axis=1, keepdims=True)
    return np.cumsum(restart, axis=1)


def counts_on(positions: np.ndarray) -> np.ndarray:
    """Bool (B, 1): rows where some token after the first sits at 0 and the next at 1, then 2 or the row's end: a packed
    document counting on from its start; 0s that never count on (GraphCodeBERT's data-flow nodes at 0 between code
    tokens at 2, 3, ... and pads at 1, 1, ...) mark a kind of token, not documents."""
    p = np.concatenate([positions, np.full((positions.shape[0], 1), 2)], axis=1)  # (the row's end counts as a 2)
    return ((p[:, 1:-2] == 0) & (p[:, 2:-1] == 1) & (p[:, 3:] == 2)).any(axis=1, keepdims=True)


def flat_positions(arguments: dict):
    """A model call's position_ids, one position per token (B, L): as given where 2-D; else its multimodal rope ids
    (C, B, L) (trace/tops.py keeps them apart, as `mrope_position_ids`): Qwen2-VL's 3 rows (t, h, w), read as the
    largest of them (all 3 are 0 only at a sample's first token: an image's grid counts on from the text before it),
    or transformers' 4, read as the text row it reads packed samples from (the first), so a restart at 0 is a packed
    sample's first token either way (EasyR1#494: (3, 1, nnz) ids of two samples, which the model no longer reads)."""
    positions = arguments.get("position_ids")
    rope = arguments.get("mrope_position_ids")
    if positions is None and isinstance(rope, np.ndarray) and rope.ndim == 3 and rope.shape[0] in (3, 4):
        return rope[0] if rope.shape[0] == 4 else rope.max(axis=0)
    return positions


def padded_positions(position_ids: np.ndarray) -> np.ndarray:
    """Bool (B, L): tokens at position 0 followed by another 0 or by the row's end: the padding a packing collator
    pads position_ids with (zeros), not a document's first token (which the next one counts on from). Their queries
    are not judged (where padding goes is the pad's business); a real query that sees them is. (A document of one
    token is so too: its query sees only itself in any mask that restarts with the documents.)"""
    nxt = np.zeros_like(position_ids)
    nxt[:, :-1] = position_ids[:, 1:]
    return (position_ids == 0) & (nxt == 0)


def documents(run: Run) -> list:
    """A query that sees another document's key, the documents marked by position_ids restarting at 0."""
    found, done = [], set()
    for call in run.calls:
        top = run.top(call)
        positions = None if top is None else flat_positions(top.arguments)
        if positions is None or positions.ndim != 2 or call.stored is None or call.shape[2] != call.shape[3]:
            continue
        real = top.arguments.get("attention_mask")
        real = real if real is not None and real.shape == positions.shape else None
        labels = document_starts(positions, real)
        if not (labels[:, -1] > 0).any() or positions.shape[1] != call.shape[3] or queries(call, top)[0] != 0:
            continue
        key = (call.mask, call.shape, labels.tobytes())
        if key in done:
            continue
        done.add(key)
        rows = max(call.shape[0], labels.shape[0])
        cells = _cells_by_row(call, rows)
        if cells is None:
            continue
        labels = np.broadcast_to(labels, (rows, labels.shape[1]))
        across = cells & (labels[:, :, None] != labels[:, None, :])
        if real is not None:
            across &= np.broadcast_to(real != 0, (rows, real.shape[1]))[:, None, :]
        across &= ~np.broadcast_to(padded_positions(positions), (rows, positions.shape[1]))[:, :, None]
        if across.any():
            b, q, k = first_cell(across)
            found.append((call, Finding("documents-leak", (
                f"position_ids restart at 0 (packed documents) but query {q} of batch row {b} sees key {k} of "
                f"another document ({int(across.sum())} such cells): the mask does not restart with them"
                f"{_kept_a_cache(top)}"),
                expected="a document mask from the position_ids", source=f"position_ids of {top.where}",
                cell=(b, q, k))))
    return found


def _kept_a_cache(top) -> str:
    """Why a transformers model may have built no document mask from restarting position_ids: its masking_utils reads
    documents from them only where neither an attention_mask nor a cache is in play (`cache is None`), and a model
    whose config says use_cache=True makes a cache of its own where the call passes none and no use_cache=False."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices") or top.arguments.get("no_cache") \
            or "attention_mask" in top.arguments or getattr(top.config, "use_cache", None) is not True:
        return ""
    return ("; transformers reads packed documents from position_ids only where no attention_mask and no cache is in "
            "play, and this model's config says use_cache=True, which the call did not turn off (use_cache=False)")


RULES = (
    Rule("padding-ignored", "wrong", "steps", "a padding key of the model call's attention_mask seen by a real query, "
         "at prefill or at a decode step", padding),
    Rule("documents-leak", "wrong", "steps", "packed documents (position_ids restarting at 0) whose mask lets a "
         "query see another document", documents),
)
