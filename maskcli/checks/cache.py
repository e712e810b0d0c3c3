"""The cache: a key column the cache never wrote must not be attended.

A static cache (transformers' StaticCache, gpt-fast's KVCache) hands attention all of its slots,
slot j holding position j once written. The model call says which positions it writes
(`cache_position`, gpt-fast's `input_pos`), or a Hugging Face cache says how many tokens it holds:
past them no slot holds a key yet (its zeros, or a previous run's stale keys). A query that sees such
a slot attends to nothing the program wrote; only real queries are judged (checks/real.py: a left-padded prompt's
padding queries see every slot where transformers unmasks their rows whole, so that they give no NaN). An encoder-decoder's cross-attention keys are its
encoder's, so it is left alone. `model` checks each column against the slot its cache returned, read
off the keys themselves (maskcli.hf.cache, widths.py: it wraps Cache.update and keeps a copy of every
key); trace reads the cache's own count instead, which costs nothing and needs no transformers here.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, band, first_cell, keep
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.checks.prefill import IDS  # (the model call's token ids, (B, T): a step's write positions are T of them)
from maskcli.text import Finding


def _written(call, top) -> tuple[np.ndarray, str] | None:
    """(the positions this call writes, what says so) for a call over a static cache's slots, else None: no slot past
    the last of them holds a key.

    gpt-fast's and transformers' older calls say which positions they write (`input_pos`, `cache_position`): the
    slots past the last one hold no key. transformers 5.24's generate passes neither to a static cache's model call;
    trace then reads the cache itself (trace/tops.py): its tokens once the call wrote its own (`cache_length`) and
    its static layers' slot counts (`cache_slots`). A call whose keys are one static layer's whole buffer has
    slots [0, cache_length) written and the rest empty: a full layer always (cache_utils.py StaticLayer.update,
    462-494), a sliding one until it fills (StaticSlidingWindowLayer.update, 602-618); once full, a sliding layer
    returns its last window in order, all written (583-588, 621-624), never more keys than it holds.
    """
    q_len, k_len = call.shape[2:]
    ids = next((top.arguments[name] for name in IDS if isinstance(top.arguments.get(name), np.ndarray)), None)
    for name in ("cache_position", "input_pos"):
        found = top.arguments.get(name)
        if isinstance(found, np.ndarray) and found.size:
            found = found.reshape(-1)
            if ids is not None and ids.ndim == 2 and ids.shape[1] != len(found):
                return None  # (not one position per token of the step: one per batch row, each row's own count,
                # JetStream's ring-buffer slots whose RoPE input_pos is no slot the step writes)
            return (found, name) if len(found) == q_len else None
    held, sizes = top.arguments.get("cache_length"), top.arguments.get("cache_slots") or ()
    if isinstance(held, int) and k_len in sizes and q_len <= held:
        cache = top.arguments.get("past_key_values", "cache")
        return np.arange(held - q_len, held), ("its cache dict's cache_index" if cache == "dict" else f"the {cache}'s length")
    return None


def unwritten(run: Run) -> list:
    found = _unwritten(run) + past_written(run)
    said = {call.where for call, _ in found}  # (a site told of slots past its own is not told of gaps besides)
    return found + [(call, finding) for call, finding in gaps_seen(run) if call.where not in said]


def gaps_seen(run: Run) -> list:
    """(call, Finding) for a step over a cache buffer whose real queries see slots before the run it wrote that hold
    nothing, after a slot that holds a key (trace/slotwrites.py's "gaps": K's and V's cells 0 there; collabora/
    WhisperSpeech 20bbb6c4: the prompt's columns never prefilled, every later step attending their empty slots)."""
    found, done = [], set()
    for call in run.calls:
        gaps, top = call.details.get("gaps"), run.top(call)
        rows = call.shape[0]
        if not gaps or len(gaps) != rows or call.mask in done or (cells := keep(call)) is None \
                or _queries_before(run, call) >= min(start for start, _ in call.details["written"]):
            continue  # (as many queries ran at the site as slots precede the write: each slot held a key once; a zero
            # one is a token's own, a pad's under bias-free projections)
        cells = by_row(cells, rows)
        real = resolve(call, top, cells).queries if top is not None else np.ones((rows, call.shape[2]), bool)
        hole = np.zeros((rows, call.shape[3]), bool)
        for b, slots in enumerate(gaps):
            hole[b, slots] = True
        bad = cells & real[:, None, :, None] & hole[:, None, None, :]
        if bad.any():
            done.add(call.mask)
            b, h, q, k = first_cell(bad)
            count = int(bad.any(axis=(1, 2)).sum())
            found.append((call, Finding("unwritten-slot", (
                f"batch row {b}: query {q} sees cache slot {k}, which holds no key (its K and V are zero) though an "
                f"earlier slot does and this step wrote slot {call.details['written'][b][0]}: {count} such slot"
                f"{'s' if count > 1 else ''} in all (a prefill that skipped them, its keys never written?)"),
                expected=f"batch row {b}: only slots the cache holds", source="the cache buffer's slots, read at the call",
                cell=(b, q, k))))
    return found


def _queries_before(run: Run, call) -> int:
    """How many queries the call's site ran over its buffer before it, back to the step that began writing it (the
    nearest earlier call with no write read: the buffer's first call, a prefill)."""
    count = 0
    for one in reversed([one for one in run.sites().get(call.where, ()) if one.index < call.index]):
        count += one.shape[2]
        if not one.details.get("written"):
            break
    return count


def _unwritten(run: Run) -> list:
    found, done = [], set()
    for call in run.calls:
        top = run.top(call)
        if top is None or getattr(top.config, "is_encoder_decoder", False) or call.details.get("slots") is not None:
            continue
        written = _written(call, top)
        if written is None or call.mask in done:
            continue
        positions, said = written
        end = int(positions.max()) + 1
        k_len = call.shape[3]
        if k_len <= end:
            continue
        done.add(call.mask)
        if call.where in pooled(run):
            continue  # (a pool of pages: its slots are no positions, decided before the call's cells are read)
        cells = keep(call)
        if cells is None:
            continue
        rows = max(cells.shape[0], call.shape[0])
        real = resolve(call, top, by_row(cells, rows)).queries  # (B, Lq): a padding query's row is unmasked whole on
        if cells.shape[0] == 1 and (real == real[:1]).all():  # purpose (no NaN); a mask broadcast over the batch
            real = real[:1]  # rows is counted once, as stored
        stop = _appended(cells, real, positions, end)
        bad = cells[..., end:stop] & real[:, None, :, None]
        if bad.any():
            b, h, q, k = first_cell(bad)
            query, count = int(positions[q]), int(bad.sum())
            found.append((call, Finding("unwritten-slot", (
                f"query {query} sees cache slot {end + k} of {k_len}, which holds no key yet: this call's cache holds "
                f"positions up to {end - 1} ({said}); {count} such cell{'s' if count > 1 else ''}"),
                expected=f"no key past slot {end - 1}", source=f"{said} of {top.where}", cell=(b, query, end + k))))
    return found


def pooled(run: Run) -> set:
    """The call sites whose keys are a pool of slots the requests share, no batch row's own buffer: at some call two
    batch rows that attend see no slot in common (attention-gym's PagedAttention, each request on its own pages of
    one buffer). A static cache gives each row its own buffer, slot j position j, so rows see the same first slots
    (padding aside); in a pool the positions a call writes number no slot."""
    held = run.__dict__.get("_pooled")
    if held is not None and held[0] == (id(run.calls), len(run.calls)):
        return held[1]
    found = set()
    for call in run.calls:
        if call.shape[0] < 2 or call.where in found or (cells := keep(call)) is None or cells.shape[0] < 2:
            continue
        seen = cells[:16].any(axis=(1, 2)).astype(np.int64)  # (B, Lk): the slots each row sees
        shared = seen @ seen.T
        attending = seen.any(axis=1)
        if ((shared == 0) & attending[:, None] & attending[None, :]).any():
            found.add(call.where)
    run.__dict__["_pooled"] = ((id(run.calls), len(run.calls)), found)
    return found


def _appended(cells: np.ndarray, real: np.ndarray, positions: np.ndarray, end: int) -> int:
    """The first key column that is no cache slot: k_len - Lq where the step's own keys are appended after the whole
    buffer (an exported static graph's `cat([k_cache, k])`: ExecuTorch's and QNN's llama, a TensorRT runtime's), the
    step's real queries seeing those keys causally and never the slot at their position; else k_len (slot j holds
    position j). One query says it as well: it sees the last key and not the slot at its own position, where its own
    key would lie were slot j position j (QNN's llama decoding one token a step, ar_len 1: executorch#20736's fix)."""
    k_len, q_len = cells.shape[-1], cells.shape[-2]
    tail = k_len - q_len
    if tail < end or q_len > len(positions) or q_len == 1 and int(positions[0]) >= tail:
        return k_len
    asking = np.broadcast_to(real[:, None, :], cells.shape[:3])
    block = cells[..., tail:]  # (B, H, Lq, Lq): the appended keys, causal among the step's queries
    causal = band(q_len, q_len, 0, False)
    at = positions[:q_len].astype(np.int64)
    slot = cells[:, :, np.arange(q_len), np.clip(at, 0, k_len - 1)]  # (B, H, Lq): its slot read as its position
    between = (cells[..., end:tail] & asking[..., None]).any() if q_len == 1 else False  # (one query that sees slots
    # past its own besides the last one reads slot j as position j: TransformerEngine#119's decode mask turned round)
    if asking.any() and ((block == causal) | ~asking[..., None]).all() and not (slot & asking).any() and not between:
        return tail
    return k_len


def past_written(run: Run) -> list:
    """(call, Finding) for a step over a cache buffer that wrote its queries' keys to slots [p, p + Lq) of a batch
    row (trace/slotwrites.py's "written": where the buffer changed since the site's last call), whose mask keeps that
    row's slots as one run [0, end) from slot 0 with end past p + Lq and short of the buffer's last slot: the
    queries are the newest tokens, and the mask's length counts slots past them (vllm-ascend#14883: a draft step's
    seq_lens still counting the verify step's rejected drafts). A buffer whose every slot is kept (one that rolls,
    slot p the newest and the ones after it older) and a mask of other shape are left alone."""
    found, done = [], set()
    for call in run.calls:
        wrote = call.details.get("written")
        if not wrote or call.details.get("slots") is not None or call.mask in done:
            continue
        cells = keep(call)
        rows, _, q_len, k_len = call.shape
        if cells is None or len(wrote) not in (1, rows) or cells.shape[0] not in (1, rows):
            continue
        kept = by_row(cells, rows).any(axis=1)  # (B, Lk): the slots some query of the row keeps
        for b in range(rows):
            start, stop = wrote[b % len(wrote)]
            row = kept[b]
            end = int(row.argmin()) if not row.all() else k_len
            if stop >= end or end >= k_len or row[end:].any() or not row[:stop].all():
                continue  # (the row's mask stops at its newest slot, or is no run from slot 0 short of the end)
            done.add(call.mask)
            found.append((call, Finding("unwritten-slot", (
                f"batch row {b}'s {'query' if q_len == 1 else 'queries'} wrote {'its key' if q_len == 1 else 'their keys'} "
                f"to cache slot{'s' if q_len > 1 else ''} {start}{'' if q_len == 1 else f'-{stop - 1}'} at this step (the "
                f"newest token{'s' if q_len > 1 else ''}), and {'it sees' if q_len == 1 else 'they see'} slot{'' if end - 1 == stop else 's'} "
                f"{stop if end - 1 == stop else f'{stop}-{end - 1}'} past {'it' if q_len == 1 else 'them'}: the mask's length ({end}) counts {end - stop} "
                f"slot{'s' if end - stop > 1 else ''} no token of this sequence holds yet (stale keys: a length not "
                f"brought back after a step, e.g. rejected drafts)"),
                expected=f"batch row {b}: slots 0-{stop - 1} only", source="the slots this step wrote in the cache "
                "buffer it hands attention (where the buffer changed since the site's last call)",
                cell=(b, start, stop))))
            break
    return found


RULES = (
    Rule("unwritten-slot", "wrong", "steps", "a static cache's slots not yet written, attended (the mask built for "
         "the written length, or none), or slots past the ones a step wrote its own keys to", unwritten),
)
