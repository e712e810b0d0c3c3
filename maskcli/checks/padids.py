"""A padding mask the program holds that calls real the token ids its own batch pads with.

A function on the stack at an attention call may hold both the batch's token ids (`input_ids`, trace/held.py's kind
"ids") and a padding mask named as one (`attention_mask`: 1 = real). Where the ids of some rows end (or begin) in a run
of one id the other rows do not have there, an id found nowhere else in the batch, two rows at least padded with it,
the rows' runs of different lengths and at least one run two long, that run is the data's own padding (pad_sequence's `padding_value`); a mask
that calls its keys real, and a kernel that lets queries see them, contradict it (under a causal mask over right
padding only the padded queries see them; the mask held is what is wrong): the mask was filled by the
wrong axis or never from the lengths (xtuner#859: `attention_mask[:i] = True` sets whole batch rows, so every row is
all ones and the right padding is attended). A mask that keeps to the ids' padding is held.py's to judge; a batch with
no run of one id at an edge (unpadded, or padded with an id its text uses too, as an eos that pads) says nothing here.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, queries, real_queries
from maskcli.checks.registry import Rule
from maskcli.checks.ringed import rolled
from maskcli.text import Finding


def id_padding(tokens: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(bool (B, L) real tokens, the pad id) where the ids of some rows end (or begin, all rows the same way) in a run
    of one id found nowhere else in the batch, two rows at least have it and one not, the runs differ and one is at
    least two long (a sampled token repeated at one row's end is no padding); else None."""
    if tokens.ndim != 2 or tokens.shape[0] < 2 or tokens.shape[1] < 3:
        return None
    for flip in (False, True):  # right padding, then left
        ids = tokens[:, ::-1] if flip else tokens
        last = ids[:, -1]
        for pad in np.unique(last):
            same = ids == pad
            run = np.where(same.all(axis=1), ids.shape[1], np.argmax(~same[:, ::-1], axis=1))  # (0 where it ends otherwise)
            real = np.arange(ids.shape[1])[None, :] < (ids.shape[1] - run)[:, None]
            if run.min() == 0 and run.max() >= 2 and (run > 0).sum() >= 2 and len(set(run.tolist())) > 1 \
                    and real.sum(axis=1).min() > 0 and not same[real].any():
                return (real[:, ::-1] if flip else real), int(pad)
    return None


def _ends_on_run(mask: np.ndarray, real: np.ndarray) -> bool:
    """The mask keeps, past the ids' reading, only the first token of each row's pad run: the pad id is also the
    terminator each text ends with (an EOS that pads: the DPO reference implementation's tokenizer), kept as a token;
    the rest of the run it masks (written blind, quiet-r69a)."""
    counts = real.sum(axis=1)  # (right padding: each row's first run position; left: its last)
    at = counts if real[:, 0].all() else real.shape[1] - counts - 1
    edge = np.arange(real.shape[1])[None, :] == at[:, None]
    return not (mask & ~real & ~edge).any() and not (~mask & real).any()


def _handed(top) -> list:
    """The model call's own `input_ids` and 0/1 `attention_mask` as held.py would hold them (a library model's forward,
    transformers', holds them in frames held.py does not read: xtuner#829 handed its collated batch to LlamaForCausalLM)."""
    arguments = {} if top is None else top.arguments
    ids, given = arguments.get("input_ids"), arguments.get("attention_mask")
    if not (isinstance(ids, np.ndarray) and isinstance(given, np.ndarray) and ids.ndim == 2 and given.shape == ids.shape
            and np.isin(given, (0, 1)).all()):
        return []
    where = f"the model call {top.where}"
    return [{"kind": "ids", "rows": ids, "name": "input_ids", "where": where},
            {"kind": "keep", "rows": given != 0, "name": "attention_mask", "where": where}]


def pad_ids_unmasked(run: Run) -> list:
    """Calls whose queries see keys the batch's own pad ids pad, while a padding mask held beside calls them real."""
    found, done, handed = [], {}, {}
    square = [call for call in run.unmasked if call.api == "softmax" and call.shape[2] == call.shape[3] > 1]
    for call in [*run.calls, *square]:  # (a softmax that masks nothing: an all-ones mask filled is one, as held.py reads)
        top = run.top(call)
        if id(top) not in handed:  # (once per model call: the key below holds its arrays by id)
            handed[id(top)] = _handed(top)
        helds = [*(call.details.get("held_padding") or ()), *handed[id(top)]]
        if not helds or call.stored is None or cross(call):
            continue
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key in done:
            if done[key] is not None:
                found.append((call, done[key]))
            continue
        done[key] = None
        masks = [h for h in helds if h["kind"] == "keep" and h["rows"].ndim == 2 and h["rows"].shape == (rows, k_len)]
        for held in [h for h in helds if h["kind"] == "ids" and h["rows"].shape == (rows, k_len)]:
            reading = id_padding(held["rows"])
            said = [m for m in masks if reading is not None and (m["rows"] & ~reading[0]).any()
                    and m.get("where") == held.get("where") and not _ends_on_run(m["rows"], reading[0])]
            # (ids and mask of one function: a batch of an outer frame, over as many keys by chance, is another batch:
            # the training batch beside a generate loop's mask)
            if not said:
                continue
            cells = keep(call)
            if cells is None or cells.shape[0] not in (1, rows):
                break
            cells = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
            real, pad = reading
            own = queries(call, run.top(call))
            real_q = real_queries(real, own) if own is not None else np.ones((rows, q_len), dtype=bool)
            bad = cells & ~real[:, None, :] & said[0]["rows"][:, None, :]
            if not bad.any():
                continue
            # (under a causal mask over right padding only padded queries see them: the mask is no less wrong, and
            # whatever reads those rows (a pooled output, a varlen unpadding by the mask) reads pad tokens as text)
            only = "" if (bad & real_q[:, :, None]).any() else ", padded queries only"
            if only and said[0]["name"] == "mask":  # (a plain `mask` that only padded queries' keys contradict may be
                continue  # the loss's, beside `targets`: it counts the pad tokens' stop targets; trajectory-transformer)
            b, q, k = first_cell(bad & real_q[:, :, None] if only == "" else bad)
            mask = f"{said[0]['name']} in {said[0]['where']}"
            done[key] = Finding("pad-ids-unmasked", (
                f"batch row {b}: query {q} sees key {k}, which the batch's own token ids pad ({held['name']} "
                f"{'ends' if real[:, 0].all() else 'begins'} in a run of id {pad}, found nowhere else, in "
                f"{int((~real).any(axis=1).sum())} of {rows} rows), and {mask} calls it real ({int(bad.sum())} such "
                f"cells{only}) — the padding mask filled along the wrong axis, or not from each row's length?"),
                expected=f"no real query sees a key {held['name']} pads with id {pad}", source=mask, cell=(b, q, k))
            found.append((call, done[key]))
            break
    return found


def left_padding_attended(run: Run) -> list:
    """Calls whose real queries see a key slot every left padding the program holds there (`left_padding`, a batch
    cache's `left_padding`) calls padding."""
    found, done, ring = [], {}, rolled(run)
    square = [call for call in run.unmasked if call.api == "softmax" and call.shape[2] == call.shape[3] > 1]
    for call in [*run.calls, *square]:
        helds = [h for h in call.details.get("held_padding") or () if h["kind"] == "left"]
        if not helds or call.stored is None or cross(call) or call.index in ring:  # (a ring's slots: ringed.py)
            continue
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        key = (call.mask, call.shape, tuple(h["rows"].tobytes() for h in helds))
        if key in done:
            if done[key] is not None:
                found.append((call, done[key]))
            continue
        done[key] = None
        helds = [h for h in helds if h["rows"].shape[0] == rows and h["rows"].max() < k_len]
        cells = keep(call) if helds else None
        if cells is None or cells.shape[0] not in (1, rows):
            continue
        cells = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
        own = queries(call, run.top(call))
        first, kept = None, False
        for held in helds:  # (several: quiet where any is kept to)
            real = np.arange(k_len)[None, :] >= held["rows"][:, None]
            bad = cells & real_queries(real, own)[:, :, None] & (cells & real[:, None, :]).any(axis=2)[:, :, None] \
                & ~real[:, None, :]
            if not bad.any():
                kept = True
                break
            first = first or (held, bad)
        if kept or first is None:
            continue
        held, bad = first
        b, q, k = first_cell(bad)
        said = f"{held['name']} in {held['where']}"
        done[key] = Finding("left-padding-attended", (
            f"batch row {b}: query {int(own[q])} sees key {k}, one of the {int(held['rows'][b])} slots {said} calls "
            f"this row's left padding ({int(bad.sum())} such cells over {k_len} keys) — the mask built without the "
            f"padding the batch (or its cache) records?"),
            expected=f"no real query sees a slot before {held['name']}", source=said, cell=(b, q, k))
        found.append((call, done[key]))
    return found


MASKS = ("attention_mask", "padding_mask", "key_padding_mask", "pad_mask", "input_mask", "mask", "src_key_padding_mask",
         "lengths", "seq_lens", "seq_lengths", "input_lengths")  # (any padding the model call is given: not this rule's)


def left_pads_never_masked(run: Run) -> list:
    """A model call given left-padded token ids and no padding mask at all, whose real queries see the pad keys."""
    found, done = [], set()
    for call in run.calls:
        top = run.top(call)
        if top is None or call.stored is None or cross(call) or any(n in top.arguments for n in MASKS) \
                or any(h["kind"] in ("keep", "left") for h in call.details.get("held_padding") or ()):
            continue  # (a mask given or held, however wrong, is the other rules' to judge)
        tokens = next((top.arguments[n] for n in ("input_ids", "idx", "tokens")
                       if isinstance(top.arguments.get(n), np.ndarray)), None)
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if tokens is None or tokens.shape != (rows, k_len) or (id(top), call.mask, call.shape) in done:
            continue
        done.add((id(top), call.mask, call.shape))
        reading = id_padding(tokens)
        if reading is None or not reading[0][:, -1].all():
            continue  # (left padding only: a run at the rows' ends is as often a run of mask tokens to fill)
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, rows):
            continue
        cells = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
        real, pad = reading
        own = queries(call, top)
        bad = cells & real_queries(real, own)[:, :, None] & ~real[:, None, :]
        if not bad.any():
            continue
        b, q, k = first_cell(bad)
        finding = Finding("left-pads-never-masked", (
            f"batch row {b}: query {int(own[q])} sees key {k}, which the batch's own token ids pad (each padded row of "
            f"{top.where}'s input ids begins with a run of id {pad}, found nowhere else, in "
            f"{int((~real).any(axis=1).sum())} of {rows} rows), and the model call was given no padding mask at all "
            f"({int(bad.sum())} such cells; step {call.step}) — the batch's attention_mask dropped on the way to the "
            f"model?"), expected=f"no real query sees a key the ids pad with id {pad}", source=f"the input ids of {top.where}",
            cell=(b, int(own[q]), k))
        found.append((call, finding))
    return found


RULES = (
    Rule("pad-ids-unmasked", "wrong", "call", "a query that sees a key the batch's own token ids pad (a run of one "
         "id at the rows' edge, found nowhere else) while the padding mask held beside them calls it real",
         pad_ids_unmasked),
    Rule("left-padding-attended", "wrong", "call", "a real query that sees a key slot the left padding the program "
         "holds (`left_padding`, a batch cache's `left_padding`) calls padding, at prefill or decode", left_padding_attended),
    Rule("left-pads-never-masked", "wrong", "call", "a real query that sees a key the batch's own token ids left-pad (a "
         "leading run of one id found nowhere else, runs of different lengths) where the model call was given no "
         "padding mask at all", left_pads_never_masked),
)
