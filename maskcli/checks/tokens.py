"""The model call's attention_mask against its own input ids and the pad id the program states.

The pad id is the model's (config `pad_token_id`, the module's, its embedding's `padding_idx`: trace/tops.py) or
else the tokenizer's the program holds where it calls the model (trace/tokenizer.py, with its `padding_side`).
Where the attention_mask disagrees with the ids, the ids win: they are the data itself.

- padding-unmarked: each batch row's tokens at the pad id (not also the EOS or BOS id) form one run at the row's
  start or end (on the tokenizer's `padding_side` where it states one), yet the attention_mask marks them 1 and a
  real query sees them (Automodel#3704: a pad run looked for at the end of left-padded rows, the pad id 0 read as
  EOS by `pad or eos`: an all-ones mask, real tokens attend the padding). Also where rows of one batch disagree on
  the pad run that ends them, one row's marked padding and another's real (checks/padruns.py: trl#487).
  The ids are the model call's by name, else its first argument where that is 2-D integer ids under another name
  (huggingface/transformers#25908: SpeechT5's `_generate_speech` handed its text encoder `input_values` padded with
  the pad id and `torch.ones_like(input_values)`: the decoder's every step attended the padding).
  The ids and the mask may be held by a function inside the model call instead (`input_ids` beside the
  `attention_mask` of the same function, trace/held.py: FewRel#17's BertModel.forward under a wrapper handed a dict).
- real-tokens-masked: the attention_mask marks 0 tokens that are not the pad id, of at least two different ids in
  one row (padding is one id; these are text), or of one id inside the row (real tokens before and after it:
  OpenRLHF 01b8a23d's `seq != eos & seq != pad` hid every chat turn's EOS), and the attention hides from a query such a token before it
  (0xallam/Direct-Preference-Optimization#1: the collator's mask zero over every response token, so no response
  token attends the response before it). Left alone where no id of the batch is the pad id and the mask's 0s are a
  padded batch's (one run at one edge of a row, the longest row unpadded): the mask is then the only padding the
  program states, over filler ids (transformers#46077's fix: random ids, `attention_mask[1, 7:] = 0`); and a BOS.
- sees-its-target: the program's loss takes the model call's own input ids shifted by one as its targets (trace/
  losses.py: a next-token predictor), yet a query sees the key one position after it, the very token it is asked
  to predict (pytorch/tutorials#2478: the word-language-model tutorial ran nn.TransformerEncoder without its
  square subsequent mask). Only positions whose target the loss counts are judged (a prefix whose labels are
  ignored may attend both ways). A real query that sees no key under a finite fill weighs every key alike, its
  target among them (swiss-ai/Megatron-LM#40: every BOS row masked, filled with -10000). A feature-map linear
  attention summed over every key is a call that sees them all (trace/linearattn.py), and a compound-word model's
  (B, L, F) ids are read field by field (trace/fieldids.py: MIDI-Transformer#1, `self_attention_type: linear`).
- padding-inverted: a padding mask the model call is given (`padding_mask`, `key_padding_mask`, `pad_mask`: True
  = padding; `attention_mask`: 1 = real) over the same (batch, length) as a float input whose samples are exactly 0
  in one run at an edge of each padded row (F.pad's zeros), and the mask calls padding exactly the samples that are
  not zero and real exactly the zero run: the mask is the wrong way round for its own data (earthspecies/avex#26: the
  collator's mask True on the real audio, BEATs reading True as padding).
- trained-token-masked: the loss's targets (as sees-its-target reads them) train on a token the attention_mask marks
  0 inside its row, real tokens after it, and a later real query that sees a key before it does not see it
  (InternLM/xtuner#567: `input_ids.ne(pad_index)` with pad == EOS masks every turn's EOS of a multi-turn sample).
  A 0 at the row's end is left alone (no real query after it), as are tokens the loss ignores.
Left alone: no pad id stated, a mask not 0/1 or not over the ids, an encoder-decoder's mask (its encoder's), and a
decoder's start token at the pad id (T5, BART, Chronos: `decoder_start_token_id == pad_token_id`): every row begins
with exactly one token at the pad id, where the config states that start id or the module's calls cross-attend to an
encoder (a decoder's left padding would differ from row to row).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.arguments import _cells_by_row, _seen_padding
from maskcli.checks.context import Run, columns_are_positions, cross, first_cell, queries, real_queries
from maskcli.checks.othermask import borrowed
from maskcli.checks.padruns import at_bos, bounded_inside, disagreeing, filler_kept, inside as _inside, not_text
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.checks.sides import DECODER, ENCODER  # (a module path's decoder, encoder)
from maskcli.text import Finding

TOKENS = ("input_ids", "idx", "tokens")
LINEAR = ("; its linear attention sums φ(k) vᵀ over every key (a non-causal feature-map attention, trace/linearattn.py), "
          "where a causal one takes a prefix sum over the keys")


def _pad(arguments: dict) -> tuple[int, str] | None:
    if isinstance(arguments.get("pad_id"), int):
        return arguments["pad_id"], "the model's pad id"
    if isinstance(arguments.get("tokenizer_pad_id"), int):
        return arguments["tokenizer_pad_id"], f"the pad id of {arguments.get('tokenizer', 'the tokenizer')}"
    return None


def _ids(arguments: dict) -> np.ndarray | None:
    """The model call's token ids: by name, else its first argument where that is a 2-D integer tensor under another
    name (trace/tops.py's `first_ids`: SpeechT5's text encoder is handed `input_values`, ids beside its embedding's
    padding_idx)."""
    ids = next((arguments[n] for n in TOKENS if isinstance(arguments.get(n), np.ndarray)), None)
    if ids is None and "first_ids" in arguments:
        ids = arguments["first_ids"][1]
    return ids


def _run_at_edge(pad: np.ndarray, side: str | None) -> bool:
    """Each row's pad tokens are one run at its start (left) or its end (right), one side for every row."""
    count = pad.sum(axis=1, keepdims=True)
    columns = np.arange(pad.shape[1])[None, :]
    left = bool(((columns < count) == pad).all())
    right = bool(((columns >= pad.shape[1] - count) == pad).all())
    return {"left": left, "right": right}.get(side, left or right)


def _leading_runs(at_pad: np.ndarray, side: str | None) -> np.ndarray | None:
    """Where the pad id is also the EOS (or BOS) id: the run at the pad id each row begins with, where each padded
    row's is two long at least (an EOS ends a text and a BOS begins one: two in a row at a row's start do neither; the
    same id later in a row is text), else None. Model-Optimizer#1673: generate's preview, pad == eos, no mask."""
    if side == "right":
        return None
    lead = np.cumprod(at_pad, axis=1).astype(bool)
    count = lead.sum(axis=1)
    return lead if count.any() and (count[count > 0] >= 2).all() else None


def _filler(at_pad: np.ndarray, given: np.ndarray, side: str | None) -> bool:
    """The attention_mask is the batch's only padding statement: no id of the batch is the pad id, and its 0s are the
    shape of a padded batch (one run at one edge of each row, the longest row unpadded): the ids under them are filler
    (random ids a test draws beside a hand-made mask, transformers#46077's embedding batch), not masked text."""
    zeros = given == 0
    return not at_pad.any() and _run_at_edge(zeros, side) and not zeros.all(axis=1).any() \
        and not zeros.any(axis=1).all()


def _start_token(run: Run, top, at_pad: np.ndarray, pad_id: int) -> bool:
    """Every row begins with one token at the pad id, a decoder's start token: the config says the start id is the pad
    id, or the module's own calls cross-attend to an encoder (an encoder-decoder's decoder, however its config is held)."""
    if not (at_pad[:, 0].all() and (at_pad.sum(axis=1) == 1).all()):
        return False
    if getattr(top.config, "decoder_start_token_id", None) == pad_id:
        return True
    return any(run.top(call) is top for call in run.cross) \
        or any(run.top(call) is top and cross(call) for call in run.calls)


def _calls(run: Run, top, rows: int, length: int, unmasked: bool = False):
    """(call, cells (rows, Lq, Lk) over the heads, query positions) of the top's attention calls over its tokens.
    `unmasked`: also its softmax calls that mask nowhere, square over the tokens (an all-ones mask that hides no pad)."""
    done = set()
    square = [call for call in run.unmasked if call.shape[2] == call.shape[3] == length] if unmasked else []
    for call in [*run.calls, *square]:
        if run.top(call) is not top or call.stored is None or call.shape[0] != rows or call.shape[3] != length \
                or not columns_are_positions(call, top) or (call.mask, call.shape) in done:
            continue
        done.add((call.mask, call.shape))
        cells = _cells_by_row(call, rows)
        if cells is not None:
            yield call, cells, queries(call, top)


def tokens(run: Run) -> list:
    """The attention_mask's padding against the ids at the stated pad id (both ways: padding marked real, text masked)."""
    found, seen = [], set()
    for top in run.tops:
        arguments = top.arguments
        ids = _ids(arguments)
        given = arguments.get("attention_mask")
        pad = _pad(arguments)
        if ids is None or pad is None or not isinstance(given, np.ndarray) or ids.ndim != 2 or given.shape != ids.shape \
                or not np.isin(given, (0, 1)).all() or getattr(top.config, "is_encoder_decoder", False):
            continue
        key = (ids.tobytes(), given.tobytes(), pad)
        if key in seen:
            continue
        seen.add(key)
        pad_id, said = pad
        rows, length = ids.shape
        at_pad = ids == pad_id
        others = {arguments.get(n) for n in ("eos_id", "tokenizer_eos_id", "tokenizer_bos_id")} - {None}
        side = arguments.get("padding_side")
        padded = at_pad if pad_id not in others else _leading_runs(at_pad, side)
        before = len(found)
        if padded is not None and padded.any() and not padded.all(axis=1).any() and _run_at_edge(padded, side) \
                and (padded & (given == 1)).any() and not _start_token(run, top, padded, pad_id) \
                and not (bounded_inside(padded, given) and not borrowed(run, top, ids, given, pad_id)):
            found += _unmarked(run, top, padded, given, pad_id, said, side)
        if len(found) == before:  # (rows that disagree on the pad run ending them: padruns.py)
            found += disagreeing(top, _calls(run, top, rows, length, unmasked=True), at_pad, given, pad_id, said)
        hidden = (given == 0) & ~at_pad & ~at_bos(ids, top, pad_id) \
            & ~not_text(top, ids, given, at_pad)  # (a later packed example's BOS, padding, past the end: padruns.py)
        if not _filler(at_pad, given, side) and any(len(np.unique(ids[b][hidden[b]])) >= 2
                                                    or _inside(hidden[b], given[b], ids[b]) for b in range(rows)):
            found += _masked(run, top, hidden, given, pad_id, said)
    return found + _held_unmarked(run, seen)


def _held_unmarked(run: Run, seen: set) -> list:
    """padding-unmarked where the ids and their mask are held by a function inside the model call (an encoder's
    `BertModel.forward(input_ids, attention_mask)` called by a wrapper handed a dict: FewRel#17), not its arguments."""
    found = []
    for call in [*run.calls, *run.unmasked]:  # (a softmax over an all-ones additive mask masks nowhere: engine.py)
        helds = call.details.get("held_padding") or ()
        rows, k_len = call.shape[0], call.shape[3]
        for ids in (h for h in helds if h["kind"] == "ids" and h["rows"].shape == (rows, k_len)):
            given = next((h for h in helds if h["kind"] == "keep" and h["where"] == ids["where"]
                          and h["rows"].shape == (rows, k_len)), None)
            top = run.top(call)
            pad = None if top is None or given is None else _pad(top.arguments)
            if pad is None or getattr(top.config, "is_encoder_decoder", False):
                continue
            key = (ids["rows"].tobytes(), given["rows"].astype(np.int64).tobytes(), pad)  # (a bool mask held: as the
            # model call's int64 one, judged once)
            if key in seen:
                continue  # (judged already: the model call's own ids and mask, or another call of this function)
            seen.add(key)
            pad_id, said = pad
            at_pad = ids["rows"] == pad_id
            others = {top.arguments.get(n) for n in ("eos_id", "tokenizer_eos_id", "tokenizer_bos_id")} - {None}
            side = top.arguments.get("padding_side")
            if pad_id in others or not at_pad.any() or at_pad.all(axis=1).any() or not _run_at_edge(at_pad, side) \
                    or not (at_pad & given["rows"]).any() or not columns_are_positions(call, top) \
                    or _start_token(run, top, at_pad, pad_id):
                continue
            cells = _cells_by_row(call, rows)
            if cells is None:
                continue
            own = queries(call, top)
            bad = _seen_padding(cells, ~at_pad, own)
            if bad.any():
                b, q, k = first_cell(bad)
                found.append((call, Finding("padding-unmarked", (
                    f"batch row {b}: query {int(own[q])} sees key {k}, a token at {said} ({pad_id}) in the run at the "
                    f"row's edge, which {given['name']} in {given['where']} marks real beside those ids "
                    f"({ids['name']}; {int(bad.sum())} such cells): the mask was made after the padding, or with the "
                    f"wrong id"), expected="no real query sees a padding key", source=said, cell=(b, int(own[q]), k))))
    return found


def _unmarked(run: Run, top, at_pad, given, pad_id: int, said: str, side) -> list:
    rows, length = at_pad.shape
    for call, cells, own in _calls(run, top, rows, length, unmasked=True):
        bad = _seen_padding(cells, ~at_pad, own)
        if bad.any():
            b, q, k = first_cell(bad)
            where = f"{side}-padded " if side else ""
            why = ("an all-ones mask made beside padded ids (ones_like the ids?)" if (given == 1).all() else
                   borrowed(run, top, _ids(top.arguments), given, pad_id)
                   or "the padding was looked for on the wrong side or with the wrong id")
            return [(call, Finding("padding-unmarked", (
                f"batch row {b}: query {int(own[q])} sees key {k}, a token at {said} ({pad_id}) in the {where}run "
                f"at the row's edge, which the attention_mask of {top.where} marks real ({int(bad.sum())} such cells): "
                f"{why}"),
                expected="no real query sees a padding key", source=said, cell=(b, int(own[q]), k)))]
    return []


def _masked(run: Run, top, hidden, given, pad_id: int, said: str) -> list:
    rows, length = hidden.shape
    for call, cells, own in _calls(run, top, rows, length):
        inside = own < length
        text_q = np.zeros((rows, len(own)), bool)
        text_q[:, inside] = (hidden | (given == 1))[:, own[inside]]
        before = np.arange(length)[None, None, :] <= own[None, :, None]
        bad = ~cells & text_q[:, :, None] & hidden[:, None, :] & before
        if bad.any():
            b, q, k = first_cell(bad)
            count, ids = int(hidden.sum()), np.unique(ids_of(top)[hidden])
            return [(call, Finding("real-tokens-masked", (
                f"batch row {b}: query {int(own[q])} does not see key {k}, which the attention_mask of {top.where} "
                f"marks padding, but its id is not {said} ({pad_id}): {count} tokens it masks are text, "
                + (f"of {len(ids)} different ids (a mask built from the wrong part of the batch?)" if len(ids) > 1 else
                   f"all of id {int(ids[0])}, inside the row, its first right after the text and a copy after them kept "
                   f"(the text's own terminator masked and a filler seen: the mask's ones padded onto the row's ends "
                   f"instead of around its text?)" if filler_kept(hidden[b], given[b], ids_of(top)[b]) else
                   f"all of id {int(ids[0])}, inside the row (a mask built from the ids at that id: an EOS that ends "
                   f"each turn?)")), expected="every real token seen as its mask allows",
                source=said, cell=(b, int(own[q]), k)))]
    return []


def predicting(run: Run):
    """(top, bool (batch, sequence): the positions whose next token the loss counts) of each model call a loss reads."""
    for top in run.tops:
        said = top.arguments.get("next_token")
        if said is not None:
            yield top, by_batch(said)


def by_batch(said: tuple) -> np.ndarray:  # (a loss's (sequence axis, positions) read, trace/losses.py: (batch, sequence))
    return said[1] if said[0] == 1 else said[1].T


def targets(run: Run) -> list:
    """A query that sees the next position's key where the loss's targets say that token is its answer."""
    found = []
    for top, predicts in predicting(run):
        rows, length = predicts.shape
        for call, cells, own in _calls(run, top, rows, length, unmasked=True):  # (a softmax that masks nowhere:
            # the padding-only mask of a decoder its config calls no decoder, transformers#23051)
            if call.shape[2] != length or not (own == np.arange(length)).all() or top.arguments.get("next_token_by") \
                    == "decoder_input_ids" and (not DECODER.search(call.where) or ENCODER.search(call.where) or cross(call)):
                continue  # (a seq2seq's targets are its decoder's next inputs: its decoder's self-attention is read)
            bad = np.zeros(cells.shape, bool)
            q = np.arange(length - 1)
            uniform = _uniform(call, cells)  # (a row that sees no key under a finite fill weighs every key alike)
            said = stated(top, rows, length)  # (real queries only: a padding row's output, its row unmasked, is dropped)
            uniform &= (real := np.ones((rows, length), bool) if said is None else np.broadcast_to(said[0], (rows, length)))
            bad[:, q, q + 1] = (cells[:, q, q + 1] | uniform[:, q]) & predicts[:, q] & real[:, q]  # (unsloth#4100)
            if "previous_token" in top.arguments:  # (a loss on the previous token too: two streams, a forward and a
                back = (cells[:, q, q - 1] | uniform[:, q]) & by_batch(top.arguments["previous_token"])[:, q]  # backward
                bad[:, q, q + 1] &= back & (q > 0)  # LM, each blind to its own target; a call wrong for either sees both)
            if bad.any():
                b, q, k = first_cell(bad)
                by = f"`{top.arguments['next_token_by']}`" if "next_token_by" in top.arguments else "input ids"
                how = (f"sees no key, and its finite fill gives it uniform weights over every key: it sees key {k}"
                       if uniform[b, q] else f"sees key {k}")
                found.append((call, Finding("sees-its-target", (
                    f"batch row {b}: query {q} {how}, the token its loss asks it to predict (the targets of the "
                    f"program's loss are the {by} of {top.where} shifted by one; {int(bad.sum())} such queries): "
                    f"a next-token model needs a causal mask" + (LINEAR if call.details.get("by_hand") == "linear" else "")),
                    expected="causal", source="the loss's targets", cell=(b, q, k))))
                break
    return found


def _uniform(call, cells: np.ndarray) -> np.ndarray:
    """Bool (rows, Lq): the query rows that see no key and whose softmax, over a finite fill, weighs every key alike
    (kernelrows.what_api_does: a plain softmax whose fill is not -inf, nothing zeroing the row after it, no sink column)."""
    details = call.details
    finite = call.api == "softmax" and details.get("fill") not in (None, "-inf") and not details.get("sink_column") \
        and not details.get("zeroed_after")
    return ~cells.any(axis=-1) if finite else np.zeros(cells.shape[:2], bool)


def inverted(run: Run) -> list:
    """A padding mask argument that is True (padding) exactly where its float input is not zero, real on its zero run."""
    found = []
    for top in run.tops:
        zeros = top.arguments.get("zeros")
        if zeros is None:
            continue  # (most model calls: no float input with a zero run; the calls are searched only where one has it)
        first = next((call for call in run.calls if run.top(call) is top), None)
        if first is None:
            continue
        source, zero = zeros
        for name in ("padding_mask", "key_padding_mask", "pad_mask", "attention_mask"):
            given = top.arguments.get(name)
            if not isinstance(given, np.ndarray) or given.shape != zero.shape or not np.isin(given, (0, 1)).all():
                continue
            padding = (given == 1) if name != "attention_mask" else (given == 0)
            padded = zero.any(axis=1)
            if not padded.any() or not _run_at_edge(zero, None) or zero.all(axis=1).any():
                continue
            if np.array_equal(padding[padded], ~zero[padded]) and not padding[~padded].all(axis=1).any():
                b = int(np.argmax(padded))
                found.append((first, Finding("padding-inverted", (
                    f"the {name} given to {top.where} marks as padding exactly the positions of its `{source}` that are "
                    f"not zero, and as real the run of exact zeros that pads them (batch row {b}: "
                    f"{int(zero[b].sum())} zero positions called real): the mask is the wrong way round for its data"),
                    expected=f"{name} {'True' if name != 'attention_mask' else '0'} on the zero padding",
                    source=f"{name} of {top.where}")))
                break
    return found


def trained(run: Run) -> list:
    """A token the program's loss trains on (the next-token target of the position before it) that the attention_mask
    marks padding inside its row (real tokens after it), hidden from a later real query that sees a key before it."""
    found = []
    for top in run.tops:
        said, given = top.arguments.get("next_token"), top.arguments.get("attention_mask")
        if said is None or not isinstance(given, np.ndarray) or given.ndim != 2 or not np.isin(given, (0, 1)).all() \
                or getattr(top.config, "is_encoder_decoder", False):
            continue
        axis, predicts = said
        predicts = predicts if axis == 1 else predicts.T  # (batch, sequence)
        if predicts.shape != given.shape:
            continue
        rows, length = given.shape
        target = np.zeros_like(predicts)
        target[:, 1:] = predicts[:, :-1]  # (the token at p is the answer of query p - 1)
        later = np.flip(np.cumsum(np.flip(given == 1, axis=1), axis=1), axis=1) > (given == 1)  # a real token after
        inside = (given == 0) & target & later & ~at_bos(_ids(top.arguments), top, (_pad(top.arguments) or [None])[0],
                                                         given.shape)  # (a BOS masked on purpose: padruns.py)
        if not inside.any():
            continue
        at = np.arange(length)
        for call, cells, own in _calls(run, top, rows, length):
            real_q = real_queries(given == 1, own)
            sees_before = np.maximum.accumulate(cells, axis=2)  # (a key before the hidden one that the query sees)
            earlier = np.zeros_like(cells)
            earlier[:, :, 1:] = sees_before[:, :, :-1]
            bad = ~cells & earlier & real_q[:, :, None] & inside[:, None, :] & (at[None, None, :] < own[None, :, None])
            if bad.any():
                b, q, k = first_cell(bad)
                found.append((call, Finding("trained-token-masked", (
                    f"batch row {b}: query {int(own[q])} does not see key {k}, a token the program's loss trains on (the "
                    f"target of query {k - 1}) that the attention_mask of {top.where} marks padding inside the row, "
                    f"real tokens after it ({int(inside.sum())} such token{'' if inside.sum() == 1 else 's'}): a mask "
                    f"built from the ids at a pad id that is also a real token's (pad == EOS)?"), expected="every token the loss trains on seen as a "
                    "real token", source="the loss's targets", cell=(b, int(own[q]), k))))
                break
    return found


def ids_of(top) -> np.ndarray:
    return _ids(top.arguments)


RULES = (
    Rule("padding-inverted", "wrong", "steps", "a padding mask argument that calls padding exactly the non-zero samples "
         "of the input it comes with and real its zero-padded run (a mask the wrong way round for its data)", inverted),
    Rule("sees-its-target", "wrong", "steps", "a query that sees the next token where the program's loss takes the "
         "input ids shifted by one as its targets (a next-token model run without its causal mask)", targets),
    Rule("padding-unmarked", "wrong", "steps", "tokens at the stated pad id in a run at the row's edge that the "
         "attention_mask marks real, seen by real queries (padding looked for on the wrong side, or the wrong id)",
         tokens),
    Rule("real-tokens-masked", "wrong", "steps", "tokens that are not the pad id, of several ids in a row or inside it, that the "
         "attention_mask marks padding and the attention hides (a collator's mask over the wrong part)", tokens),
    Rule("trained-token-masked", "wrong", "steps", "a token the program's loss trains on that the attention_mask marks "
         "padding inside its row, hidden from the real queries after it (a mask from ids whose pad id is the EOS)",
         trained),
)
