"""One call site from prefill to each decode step: what its first step shows must hold at the next ones.

A call site's prefill (a call whose first query is at position 0) says, with no config needed, which
keys are padding (keys no query of a batch row sees while another row's queries see them, as a padded
batch is; keys past its last query are a static cache's slots for later tokens, never its padding) and
whether it is a sliding window (each row sees exactly the W keys up to its own, cut by the row's first key). A decode step after it at the same site whose key columns are the same
positions (the cache keeps every key, so it has at least as many) must keep both: a padding key seen
at decode, or a query that sees more than W keys back, is the mask lost behind the cache. A later
prefill is a sequence of its own (the next batch, an encoder called again with another mask): the
decode steps after it are read against it.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import (Run, columns_are_positions, cross, equals, first_cell, found_padding, keep, queries,
                                    runs, triu)
from maskcli.checks.directions import pass_directions, read_directions
from maskcli.checks.heldcells import given_up
from maskcli.checks.rerun import causal_on_real, rerun_passes
from maskcli.checks.real import Real, by_row, resolve
from maskcli.checks.reqlens import stated_first
from maskcli.checks.ringed import rolled
from maskcli.checks.rowcausal import rows_lost
from maskcli.checks.stepcells import filling, held_after_own, placed_past_written, reaches_back, windowed
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _window(cells: np.ndarray, own: np.ndarray, real: Real, stored: dict | None = None) -> int | None:
    """W where every real query of every batch row and head of the prefill sees exactly the W keys up to its own (cut at
    its row's first real key) and the window cuts somewhere; else None. Padding query rows are not read: a window
    test that needs every query row to see a key fails on every left-padded batch. `stored`: the call's stored mask
    `cells` broadcast, read off its intervals where each row is one (no pass over the cells)."""
    judged = np.broadcast_to(real.queries[:, None, :], cells.shape[:-1])  # (B, H, Lq)
    bounds = _runs(stored, cells.shape)
    seen = cells.any(axis=-1) if bounds is None else bounds[0] < bounds[1]
    if not judged.any() or not seen[judged].all():
        return None
    k_len = cells.shape[-1]
    first = cells.argmax(axis=-1) if bounds is None else bounds[0]  # (B, H, Lq) (read on judged rows only: each sees a key)
    start = np.broadcast_to(real.keys.argmax(axis=-1)[:, None, None], first.shape)  # each row's first real key
    if not (first > start)[judged].any():
        return None  # a window that never cuts (a causal prefill's: asked first, as the cheapest)
    last = k_len - 1 - cells[..., ::-1].argmax(axis=-1) if bounds is None else bounds[1] - 1
    count = np.count_nonzero(cells, axis=-1) if bounds is None else bounds[1] - bounds[0]
    own3 = np.broadcast_to(own[None, None, :], first.shape)
    if not (last == own3)[judged].all() or not (count == last - first + 1)[judged].all():
        return None  # not one run ending at the query's own key
    width = int(count[judged].max())
    if not (first == np.maximum(start, own3 - width + 1))[judged].all():
        return None  # not a window
    return width


def _runs(stored: dict | None, shape: tuple) -> tuple[np.ndarray, np.ndarray] | None:
    """(first key, end) of each row's one run of kept keys (context.runs), broadcast to `shape[:-1]`; None for a mask of
    another form."""
    found = runs(stored, shape[-1])
    return None if found is None else (np.broadcast_to(found[0], shape[:-1]), np.broadcast_to(found[1], shape[:-1]))


def prefill_once(run: Run, call, top):
    """_prefill(call, top), read once a run for every layer's call of one mask in one model call (steps.py's sites,
    stepwindows.py and cachedrop.py ask it of the same prompt passes)."""
    read, key = run.__dict__.setdefault("_prefills", {}), (call.mask, call.shape, id(top))
    if key not in read:
        read[key] = _prefill(call, top)
    return read[key]


def _prefill(call, top):
    """(padded (B, Lk) or None, window or None) a prefill shows, on its real rows; None where it shows neither or cannot
    be read."""
    cells = keep(call)
    if cells is None or not columns_are_positions(call, top):
        return None
    real = resolve(call, top, by_row(cells, max(cells.shape[0], call.shape[0])), own_cells=True)
    own = queries(call, top)
    padded = ~real.keys
    # (keys a real query of the row sees are not padding the prefill kept: a stated padding it ignored is
    # arguments.py's padding-ignored, said there)
    batch = np.broadcast_to(cells, (real.keys.shape[0], *cells.shape[1:]))
    padded = padded & ~(batch & real.queries[:, None, :, None]).any(axis=(1, 2))
    # (keys past the prefill's last query are a static cache's unwritten slots, 0 in a mask padded to the cache
    # (Bloom's 2-D mask): later tokens written there, not padding; their own step's attention_mask says which)
    padded[:, int(own.max(initial=-1)) + 1:] = False
    padded = padded if padded.any() else None
    window = _window(np.broadcast_to(cells, (real.keys.shape[0], *cells.shape[1:])), own, real, call.stored)
    return None if padded is None and window is None else (padded, window)


class _Asking:
    """A decode step's real queries (B, 1, Lq), resolved once and only when asked (most steps hold their prefill's
    padding and window, and are never asked)."""

    def __init__(self, call, top, cells, rows):
        self.call, self.top, self.cells, self.rows, self.found = call, top, cells, rows, None

    def __call__(self) -> np.ndarray:
        if self.found is None:
            self.found = resolve(self.call, self.top, by_row(self.cells, self.rows)).queries[:, None, :]
        return self.found


def sites(run: Run) -> list:
    """Each decode step against the latest prefill (its first query at position 0) before it at its site: a later
    prefill is a new sequence (another batch, an encoder called again with another mask), not a step behind the
    cache."""
    found, judged, ring = [], {}, rolled(run)
    for where, calls in run.sites().items():
        head = shown = None
        for call in calls:
            if call.index in ring:
                continue  # (a ring's slots, overwritten since the prefill: no column is its token then, ringed.py)
            later_top, own, positions = run.placed(call)
            if own[:1].tolist() == [0]:  # a prefill (a static cache's too: its unwritten slots after)
                head, shown, done, written = call, prefill_once(run, call, later_top), {call.mask}, set()
                regrouped = False
                continue
            if shown is None and head is None and positions:
                # (no prefill here yet: the layer's prefill may have gone through another module of it, its decode
                # through a fused kernel call in the parent, H-Net's CausalMHA)
                adopted = _layer_prefill(run, where, call, own)
                if adopted is not None:
                    head, shown, done, regrouped = adopted, prefill_once(run, adopted, run.top(adopted)), set(), False
            if shown is None or call.mask in done or call.shape[3] < head.shape[3] or not positions or own[-1] < head.shape[2]:
                continue  # (queries at the prefill's own positions continue nothing: a buffer rolled under them, GPT-J's)
            written.update(own.tolist())  # (each step's queries write their slots: not the prefill's padding since)
            # (a step over another number of rows regrouped the batch, TGI's concatenate and filter: from then on a row
            # and its cache columns are not the prefill's, even where the count comes back)
            regrouped = regrouped or call.shape[0] not in (1, head.shape[0])
            done.add(call.mask)
            later = keep(call)
            if later is None:
                continue
            # every layer of one step hands its calls one mask against one prefill: judged once for all of them
            verdict = (id(shown), call.mask, call.shape, id(later_top), own.tobytes(), len(written), max(written), regrouped)
            if verdict not in judged:
                padded, window = shown
                judged[verdict] = _judge(call, later_top, later, own, None if regrouped else padded, window, written,
                                         head.shape[2])
            said = judged[verdict]
            if said is None:
                continue
            padded, window = shown
            if said[0] == "padding":
                b, q, k = said[1:]
                found.append((call, Finding("padding-lost", (
                    f"at step {call.step} query {int(own[q])} of batch row {b} sees key {k}, which no query of that "
                    f"row saw at step {head.step} (its padding): the padding is lost behind the cache"),
                    expected=f"the key padding of step {head.step}", source=f"{head.where} at step {head.step}",
                    cell=(b, int(own[q]), k))))
            else:
                b, at, back = said[1:]
                found.append((call, Finding("window-lost", (
                    f"step {head.step} of {head.where} is window({window}), but at step {call.step} query {at} "
                    f"{'' if head.where == where else f'of {where} '}sees {back + 1} keys back: the window is lost "
                    f"behind the cache"), expected=f"window({window})", source=f"{head.where} at step {head.step}",
                    cell=(b, at, at - back))))
    return found


def _layer_prefill(run: Run, where: str, call, own: np.ndarray):
    """The prefill, at a module of the same layer (this call's module's child or parent), whose keys are exactly the keys
    this decode step finds before its own (its queries continue that prefill's sequence, Lq == Lk there): one layer
    whose prefill and decode go through two modules share one cache. None where no such call came before."""
    if not where or ":" in where or not len(own) or call.shape[2] >= call.shape[3]:
        return None
    found = None
    for other, calls in run.sites().items():
        if not other or ":" in other or not (other.startswith(where + ".") or where.startswith(other + ".")):
            continue
        for before in calls:
            if before.index >= call.index:
                break
            q_len, k_len = before.shape[2:]
            if q_len == k_len == int(own[0]) and before.shape[0] == call.shape[0] and \
                    (found is None or before.index > found.index) and run.placed(before)[1][:1].tolist() == [0]:
                found = before
    return found


def _judge(call, top, later: np.ndarray, own: np.ndarray, padded, window, written: set = frozenset(),
           written_from: int = 0) -> tuple | None:
    """("padding", b, q, k) where a decode step's real query sees a key its prefill padded, else ("window", b, q, keys
    back less 1) where one sees further back than the prefill's window, else None. `written`: the positions the site's
    steps since the prefill placed their queries at, whose slots they wrote (KerasHub's sampler generates from the
    shortest prompt's end, into the longer rows' padded slots): no padding of the prefill's there any more. `written_from`:
    the prefill's own slots end there (its queries count)."""
    asking = _Asking(call, top, later, max(later.shape[0], call.shape[0]))  # its real queries, resolved where a rule would speak
    if padded is not None and later.shape[0] in (1, padded.shape[0]) and call.shape[0] in (1, padded.shape[0]):
        # (a step over another number of batch rows is another batch: its rows are not the prefill's)
        width = padded.shape[1]
        if call.shape[0] == 1 < padded.shape[0]:
            # (one sequence continued alone, taken out of the batch: mlx-lm's cache extract. Which row it was is
            # unknown, so only a key every row padded is its padding)
            padded = padded.all(axis=0, keepdims=True)
        bad = later[..., :width] & padded[:, None, None, :]  # (one mask row for every batch row broadcasts)
        at = [k for k in written if 0 <= k < width]
        if at and bad.any():
            bad = bad.copy()
            bad[..., at] = False
        if bad.any():
            bad = bad & asking()[..., None]
        if bad.any() and not held_after_own(later, padded, asking):
            b, h, q, k = first_cell(bad)
            return "padding", b, q, k
    if window is not None and reaches_back(call, later, own, window):
        # (some query sees a key W or more back: only then is how far back each sees counted)
        at = np.broadcast_to(own[None, None, :], later.shape[:-1])
        if placed_past_written(later, own, asking(), written_from, set(written) - set(own.tolist())):
            at = later.shape[-1] - 1 - later[..., ::-1].argmax(axis=-1)  # (each query at the last key it sees: its own)
        back = at - np.where(later.any(axis=-1), later.argmax(axis=-1), at)
        back = np.where(asking(), back, 0)
        if (back >= window).any() and np.broadcast_to(windowed(later, own, padded, written, window) | ~asking(), back.shape).all():
            b, h, q = first_cell(back >= window)
            return "window", b, int(at[b, h, q]), int(back[b, h, q])
    return None


def alignment(run: Run) -> list:
    """A decode step (not a site's first call) whose mask is causal aligned top-left, its queries at keys 0..Lq-1,
    where the run places them after earlier keys: each query sees the first keys, not its own."""
    found, done, first = [], set(), _first_steps(run)
    for call in run.calls:
        q_len, k_len = call.shape[2:]
        if call.step == 0 or q_len >= k_len or call.mask in done or call.stored is None or id(call) in first:
            continue
        top, own, positions = run.placed(call)
        if own[0] == 0 or not positions or stated_first(run).get(call.index) == 0 or _at_start(call):
            continue  # (an engine's metadata placing the queries at the start: the later keys are unwritten slots)
        cells = keep(call)
        if cells is not None and filling(run, call, cells):
            continue  # (a static buffer filled from its first slot: the next step's queries see the keys these see and
            # their own, over as many columns; t5x's decode from an empty cache after its training passes)
        done.add(call.mask)
        if cells is None or (cells & (np.arange(k_len)[None, :] > np.arange(q_len)[:, None])).any():
            continue  # a query that sees a key past its row number: not top-left causal, padded or not (padding only
            # takes cells away), so `equals` cannot hold (most decode steps stop here)
        if equals(cells, "causal", offset=0, kv_len=k_len, **found_padding(cells)) and not _stated_length(call, cells):
            found.append((call, Finding("top-left-mask", (
                f"at step {call.step} the mask is causal aligned top-left: query {int(own[0])} sees keys 0..0 only, "
                f"not the {int(own[0])} keys before it (a mask sliced as mask[:Lq, :Lk]; bottom-right is "
                f"mask[Lk - Lq:Lk, :Lk])"), expected=f"causal with the queries at {int(own[0])}..{int(own[-1])}",
                source=f"{call.where}: {k_len - q_len} earlier keys", cell=(0, int(own[0]), 1))))
    return found


def _stated_length(call, cells: np.ndarray) -> bool:
    """Whether every query sees exactly the keys before one length the lengths the program holds at the call state
    (hydragen's split-K decode over a right-padded suffix, read while n < seq_len[z], one row z at a time: a row of
    length 1 keeps key 0 alone, as a top-left step would): the mask is that row's padding, which the program states."""
    for held in call.details.get("held_padding") or ():
        if held["kind"] == "lengths" and any(
                (cells == (np.arange(cells.shape[-1]) < n)).all() for n in {int(n) for n in held["rows"]}):
            return True
    return False


def _at_start(call) -> bool:
    """flash_attn_with_kvcache's `cache_seqlens` (trace/positionsat.py), where the kernel writes the step's keys, puts
    every row's first query at 0: no key cached before them (not a position the program numbers its tokens by, which
    may be the bug itself: chunk positions restarting at 0)."""
    stated = call.details.get("query_positions")
    rows = stated.get("rows") if isinstance(stated, dict) and stated.get("name") == "cache_seqlens" else None
    return rows is not None and rows.size > 0 and not rows[:, 0].any()


def _first_steps(run: Run) -> set:
    """The calls that are the layers of their site's first step: those in the same model call as the site's first call,
    with its shape (one line that every layer of a forward calls in a loop, llama.cpp's graph over a static KV buffer,
    counts each layer a step; the layers of one model call share their placing, so none of them is a decode step).
    Also a later call of several queries that repeats the first call's shape, mask and placing (no position the model
    call states moved its queries; one query over a fixed buffer is a decode step, flax's) exactly: nothing was
    written between them, so it continues no sequence (sinkhorn-transformer's sort net run once per forward, its (buckets, 1 + buckets) scores
    each bucket's own null key and the buckets before it)."""
    found = set()
    for calls in run.sites().values():
        top = run.top(calls[0])
        found.update(id(call) for call in calls[1:] if call.shape == calls[0].shape and (
            top is not None and run.top(call) is top or call.mask == calls[0].mask and call.shape[2] > 1
            and np.array_equal(run.placed(call)[1], run.placed(calls[0])[1])))
    return found


def causal_lost(run: Run) -> list:
    """A call site whose mask is causal in one call of several queries and lets queries see later keys in another
    (a prefill that skips the causal mask when a cache is attached). Only a site whose cache grows (a call with fewer
    queries than keys) has prefills and decode steps; the calls of any other are independent (four BlockMasks passed
    through one line in a loop). Batches with rows that see no key (padding query rows: what they see depends on the
    kernel) are read on their real queries and keys (directions.py's reading: causal where every real query sees the
    real keys up to itself), so a left-padded prompt fed behind a cache without its causal part is one too.
    nn.MultiheadAttention applies the masks its caller hands it,
    and one module may be called causal and not (nn.TransformerEncoder with and without mask=): there a pass that
    sees later keys is a finding only where decode steps follow it at the site (a prefill)."""
    found, every_row = [], {}  # id(cells) -> (cells, whether every query row sees a key): each layer hands one mask
    for (where, _), calls in run.callers().items():
        rerun = None
        if not any(call.shape[2] < call.shape[3] for call in calls):
            rerun = rerun_passes(calls)
            if not rerun:
                continue  # no step behind a cache nor a prefix run again: independent calls (masks built in a loop,
                # one line for all), no prefill
        found += rows_lost(where, calls)  # (a pass causal in one batch row alone: rowcausal.py)
        if sum(1 for call in calls if 2 <= call.shape[2] == call.shape[3]) \
                + any(2 <= call.shape[2] < call.shape[3] for call in calls) < 2:
            continue  # (one pass of many queries at most, and no chunk of them behind a cache: no causal call before
            # another that could have lost it)
        causal = None
        for n, call in enumerate(calls):
            q_len, k_len = call.shape[2:]
            if causal is not None and 2 <= q_len < k_len:
                if n and calls[n - 1].shape[3] == k_len - q_len:
                    continue  # (a chunk continuing the call before it, its keys grown by exactly the chunk: a chunked
                    # prefill, which prefill.py puts together and holds to one pass)
                lost = _chunk_sees_later(run, call)  # (a chunk behind cached keys: an extend on a prefix-cache hit)
                if lost is not None:
                    b, q, k = first_cell(lost[0])
                    found.append((call, _lost(where, causal, call, (b, int(lost[1][q]), k), f"{int(lost[0].sum())} such "
                                              f"cells of real queries and keys, {q_len} queries behind {k_len - q_len} "
                                              "cached keys")))
                continue
            if q_len < 2 or q_len != k_len or causal is not None and rerun is not None and n not in rerun:
                continue  # (a site that decodes by running its prefix again: those passes judged, not any other)
            if causal is not None and (call.details.get("call_causal") or {}).get("causal") is False:
                continue  # (the program's own call asks this one non-causal, `causal=False` written at it: MoBA's
                # gated chunks beside its causal own chunk, through one varlen function; callcausal.py reads that word)
            if call.api == "mha" and causal is not None and rerun is None and not _decode_follows(calls[n + 1:]):
                continue
            cells = keep(call)
            if cells is None:
                continue
            if id(cells) not in every_row:
                every_row[id(cells)] = (cells, bool(cells.any(axis=-1).all()))
            if not every_row[id(cells)][1]:  # (padding query rows that see nothing: read on the real rows alone)
                got = pass_directions(run, call)  # (on the real rows and keys: padding query rows may see anything)
                if got is not None and causal is None and got[1]:
                    causal = call
                elif got is not None and causal is not None and got[0].any():
                    b, q, k = first_cell(got[0])
                    found.append((call, _lost(where, causal, call, (b, q, k), f"{int(got[0].sum())} such cells of "
                                              f"real queries and keys")))
                continue
            if causal is None:
                causal = call if equals(cells, "causal") or rerun and causal_on_real(run, call) else None
                continue  # (no causal call before it at the site: nothing it could have lost)
            got = pass_directions(run, call)
            later = triu(cells, k=1) if got is None else got[0][:, None]
            gone = given_up(call, cells)
            if gone is not None and gone.any():  # (queries the mask the program holds gives up whole, CodeGeeX's
                later = later & ~gone[:, None, :, None]  # past its context, shifted as a whole by an additive mask)
            if causal is not None and later.any():
                b, h, q, k = first_cell(later)
                found.append((call, _lost(where, causal, call, (b, q, k), f"{int(later.sum())} such cells" + (
                    "; each decode step runs the whole prefix again, with no cache, and its earlier tokens see the "
                    "later ones: the causal mask left out of the loop?" if rerun else ""))))
    return found


def _chunk_sees_later(run: Run, call) -> tuple[np.ndarray, np.ndarray] | None:
    """(bool (B, Lq, Lk), the queries' positions): real queries of a self-attention chunk of several queries behind cached keys, placed where the
    model call states (its cache positions) or at the end of the keys, that see later real keys; None where none do.
    tokenspeed#271: a prefix-cache hit's extend ran its kernel non-causal over a cache already holding the chunk's new
    keys, so each new token saw the later ones of its chunk."""
    if cross(call) or call.api == "softmax":  # (a softmax's keys need be no shared sequence: a kNN memory's retrieved
        return None  # keys, gathered per query, `b h i j d` (memorizing-transformers-pytorch, quiet_blind); a kernel
        # handed K holds the one sequence its queries read)
    top = run.top(call)
    own = queries(call, top)
    got = read_directions(call, top, own)
    return (got[0], own) if got is not None and got[0].any() else None


def _lost(where: str, causal, call, cell: tuple, count: str) -> Finding:
    b, q, k = cell
    return Finding("causal-lost", (
        f"step {causal.step} of {where} is causal, but at step {call.step} query {q} sees later key {k} ({count})"),
        expected="causal", source=f"{where} at step {causal.step}", cell=(b, q, k))


def _decode_follows(calls: list) -> bool:
    """The next call of a site is a decode step (fewer queries than keys): the call before it was a prefill."""
    return bool(calls) and calls[0].shape[2] < calls[0].shape[3]


RULES = (
    Rule("padding-lost", "wrong", "site", "key padding a call site masks at its first step and attends at a later one "
         "(left padding dropped at decode)", sites),
    Rule("window-lost", "wrong", "site", "a sliding window at a call site's first step that is gone at a later step",
         sites),
    Rule("top-left-mask", "wrong", "site", "a decode step whose mask is causal aligned top-left (sliced as mask[:Lq, :Lk]): "
         "its queries see the first keys, not their own", alignment),
    Rule("causal-lost", "wrong", "site", "a call site causal in one call and seeing later keys in another (the causal "
         "mask skipped when a cache is attached)", causal_lost),
)
