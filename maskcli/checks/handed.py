"""The sliding window the program holds where it calls the kernel, against the mask: dropped on a path, or not the
width held.

trace/windows.py records the outermost window statement of the program's frames on the way to the kernel and of the
objects whose methods they run: `window_left` = L, `window_size` / `sliding_window` = (L, 0) (FlashAttention,
FlashInfer, Transformer Engine: a query at p sees keys p - L .. p), SGLang's `sliding_window_size` = L on a layer object
(|q - k| <= L where it is an encoder's). Such a window spans at most L + R + 1 consecutive positions wherever the query
sits, and exactly that many where neither end is cut by the sequence's ends. So the rule needs no placing of the
queries (a kernel called per query tile over all the keys, SGLang's FlashInfer port, places its tiles where maskcli
cannot see): per batch row and real query, over the real keys in their order (padding resolved first):

- a query that sees two keys further apart than the window spans: the window is dropped on this path (nanochat#452's
  `Tq == 1` shortcut, a paged prefill kernel planned without its window);
- every query whose visible keys are cut by neither end seeing the same fewer keys than the window holds: the mask is a
  narrower window (a kernel whose left bound is exclusive handed the inclusive one, a mask cached for another layer's
  window). Rows of different lengths (documents, chunks) are left alone, and so is a `sliding_window_size` (LitGPT
  and Keras-hub count the query in it, SGLang does not: only the wider side is sure), and a mask that keeps the
  `sliding_window` keys the model's config states (the (W, 0) tuple a module derives from it is FlashAttention's
  convention, one key wider: eole's SelfMHA).

A one-sided window (L, 0) bounds how far back a query reaches; where the run places the queries and key column j is
position j, the keys after a query are left to the rules of causality (Gemma 3's image blocks attend both ways inside
a sliding layer, the window bounding only the keys before: gemma_pytorch's `local_mask`). Paged calls whose columns are
slots are left alone.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, columns_are_positions, cross, first_cell, keep, queries
from maskcli.checks.placing import queries_stated
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _positions(call, own: np.ndarray, positional: bool) -> np.ndarray:
    """Each key column's absolute position, as shown: j where columns are positions (`positional`:
    columns_are_positions), else the most recent keys ending at the last query (a cache sliced to the window keeps
    them)."""
    k_len = call.shape[3]
    if positional:
        return np.arange(k_len)
    last = int(own[-1])
    return np.arange(last + 1 - k_len, last + 1)


def _spans(rows: np.ndarray, real) -> tuple:
    """Per (batch row, query): whether it sees a real key, the order among the real keys of the first and last it sees,
    how many it sees, the columns of those two, and each batch row's count of real keys."""
    seen = rows & real.keys[:, None, :] & real.queries[:, :, None]
    order = np.cumsum(real.keys, axis=1) - 1  # (B, Lk): a real key's place among its row's real keys
    has = seen.any(axis=-1)
    first = seen.argmax(axis=-1)
    last = seen.shape[-1] - 1 - seen[..., ::-1].argmax(axis=-1)
    lo = np.take_along_axis(order, first, axis=1)
    hi = np.take_along_axis(order, last, axis=1)
    return has, lo, hi, seen.sum(axis=-1), first, last, real.keys.sum(axis=1)


def held_window(run: Run) -> list:
    """A real query that sees keys further apart than the window held, or a mask narrower than it."""
    found, done, kept, branches, branch = [], {}, set(), set(), {}
    for call in [*run.calls, *(one for one in run.unmasked if one.details.get("window_handed"))]:  # (a site that
        held = call.details.get("window_handed")  # masks nowhere is attention where it holds a window: jax#32300)
        if not held or len(held) != 4 or call.stored is None or call.details.get("slots") is not None \
                or _gathered(call):
            continue
        name, left, right, where = held[0], int(held[1]), int(held[2]), held[3]
        top = run.top(call)
        own = queries(call, top)
        key = (call.where, call.mask, call.shape, tuple(own), tuple(held))
        if key in done:
            if done[key] is not None:  # (the same mask kept to the window: so does this call, in its run)
                branches.update(_branch(call, held, done[key]))
            continue
        done[key] = None
        cells = keep(call)
        if cells is None:
            continue
        rows = by_row(cells, call.shape[0] if cells.shape[0] in (1, call.shape[0]) else None)
        real = resolve(call, top, rows)
        positional = columns_are_positions(call, top, own)
        square = call.shape[2] == call.shape[3] and positional
        if right == 0 and positional and (square or queries_stated(call, top)):
            rows = rows & (np.arange(call.shape[3]) <= own[:, None])  # (keys after the query: not a one-sided window's)
        has, lo, hi, count, first, last, total = _spans(rows, real)
        width = left + right + 1
        keys = _positions(call, own, positional)
        wide = has & (hi - lo + 1 > width)
        # where each query's newest key sits from its placing: the same in two calls of one run that attend the same
        # queries (each tile of a query-tiled kernel sees other keys)
        ends = (call.shape[:3], tuple(np.where(has, keys[last] - own[None, :], -1 - len(keys)).ravel().tolist())) \
            if "axes" not in call.details else _rows(call)
        said = f"{where} holds {name} = {_shown(name, left, right)} (a query at p sees keys {_reach(left, right)}" + \
            (" at most: some count the query in it)" if name == "sliding_window_size" else ")")
        expected = f"window({width})" if right == 0 else f"band({left + 1})"
        if not wide.any():
            done[key] = ends
            kept.add((call.step, call.shape[2:], tuple(held)))
            branches.update(_branch(call, held, ends))
            interior = has & (count == hi - lo + 1) & (lo > 0) & (hi < total[:, None] - 1)
            lengths = set(count[interior].tolist())
            # (sliding_window_size counts the query in LitGPT's and Keras-hub's, not SGLang's: only the span is sure)
            c = lengths.pop() if len(lengths) == 1 else None  # (the keys every uncut query sees, where one count)
            if name != "sliding_window_size" and interior.sum() >= 2 and c is not None and c < width \
                    and not _config_counts(top, c):
                b, q = first_cell(interior)
                a, z = int(keys[first[b, q]]), int(keys[last[b, q]])
                at = z if right == 0 else int(own[q])
                earlier = int(keys[np.flatnonzero(real.keys[b, :first[b, q]])[-1]])
                found.append((call, Finding("window-narrower", (
                    f"{said}, but every query whose keys no sequence end cuts sees {c} keys, not {width}: query {at} "
                    f"of batch row {b} sees keys {a} .. {z} and not {earlier}, a real key ({int(interior.sum())} "
                    f"such rows; step {call.step}): the mask is a narrower window than held"),
                    expected=expected, source=where, cell=(b, at, earlier))))
            continue
        b, q = first_cell(wide)
        a, z = int(keys[first[b, q]]), int(keys[last[b, q]])
        # a one-sided window ends at the query's own key: the newest key a row sees is where it sits, as a kernel's
        # query tile places it (a symmetric one's queries are placed as trace places them, and so are a square call's
        # over positions, every query there: its newest key may be a later one, seen where the window is dropped)
        at = z if right == 0 and not square else int(own[q])
        branch[len(found)] = (call.details.get("window_frame"), tuple(held), ends)
        found.append((call, Finding("window-dropped", (
            f"{said}, but query {at} of batch row {b} sees keys {a} .. {z}, a span of "
            f"{int(hi[b, q] - lo[b, q] + 1)} real keys where the window spans {width} ({int(wide.sum())} such rows; step {call.step}): the window "
            f"is dropped on this path"),
            expected=expected, source=where, cell=(b, at, a))))
    # a step at which another call held the same window keeps to it: the window is chosen per layer (Gemma 2's
    # alternating local and global layers, one attend() for both), not dropped on a path (the layer rules judge that);
    # and a run of the function attending, or of the module holding the window (trace/windows.py's window_frame), that
    # keeps to the window in another call over the same queries (each seeing the same newest key; a call laid out by
    # its einsum, the same count of rows) attends them by two branches (native sparse attention's block-causal or
    # selected-block fine branch beside its sliding one): the window claims one branch, not every call
    found = [(call, f) for i, (call, f) in enumerate(found) if f.code != "window-dropped"
             or ((call.step, call.shape[2:], tuple(call.details["window_handed"])) not in kept
                 and (branch[i][0] is None or branch[i] not in branches))]
    return found + _counted(run) + _counted_wide(run)


def _config_counts(top, count: int) -> bool:
    """The model call's config states `sliding_window` = `count`, the keys the mask keeps (a window that counts the
    query, as transformers' Mistral does): the (W, 0) tuple a module derives from it for FlashAttention is that path's
    convention, one key wider, not the mask's (eole's SelfMHA holds `window_size = (sliding_window, 0)` beside a mask
    path that keeps `q - sliding_window + 1 .. q`)."""
    return top is not None and any(one.fields.get("sliding_window") == count for one in top.stated)


def _gathered(call) -> bool:
    """A call an einsum laid out (details["axes"]) whose head axis holds more planes than the heads its module states:
    another axis is folded among the heads, the program's positions, whose keys it gathered per position (native
    sparse attention's selected blocks, "bhgid,bhijd->bhgij": the 40 "heads" are 2 kv heads x 20 positions): its key
    columns are slots, and its queries no positions."""
    heads = call.details.get("stated_heads")
    return "axes" in call.details and heads is not None and call.shape[1] > heads


def _rows(call) -> tuple:
    """A call laid out by its einsum (trace/layouts.py's details["axes"]): its queries are the axis only the first
    operand holds, and the program's positions may be folded among its heads ("bhgid,bhijd->bhgij", native sparse
    attention's keys gathered per position: its queries are the grouped heads), so no newest key says where its
    queries sit: the (batch row, head, query) rows it attends are only counted."""
    return "rows", call.shape[0], call.shape[1] * call.shape[2]


def _branch(call, held, ends) -> tuple:
    """What a call keeping to the window in one run (window_frame) claims: its queries' newest keys, and its count of
    rows (a laid-out call over the same rows is another branch of the same run)."""
    frame = call.details.get("window_frame")
    return (frame, tuple(held), ends), (frame, tuple(held), _rows(call))


def _counted_wide(run: Run) -> list:
    """A real query of a causal mask whose frame holds a plain int `sliding_window` = W > 0 (trace/windows.py's
    window_counted) that sees real keys spanning more than W + 1 positions: W keys or W + 1 by its convention, never
    more, so the window is dropped on this path (cascadia#151: Gemma 4's export gave its sliding layers the plain
    causal mask). Only `sliding_window` (a `window_size` int is a Swin window, a local-attention block), only where no
    query sees a later key (a symmetric window's W is one side of it), and not at a step where another call holding
    the same W over as many queries (its keys sliced to the window, maybe), or another call of the same site over as
    many queries and keys, keeps to it (the window chosen per layer
    by a mask built beside the frame's variable)."""
    found, kept, done = [], set(), {}
    for call in run.calls:
        said = call.details.get("window_counted")
        if not said or len(said) != 4 or said[0] != "sliding_window" or int(said[1]) <= 0 or call.stored is None \
                or call.details.get("window_handed") or call.details.get("slots") is not None or cross(call):
            continue
        window, where = int(said[1]), str(said[3])
        key = (call.where, call.mask, call.shape, window)
        if key in done:
            if done[key]:  # (the same mask kept to the window: so does this call, at its step)
                kept.update(((call.step, call.shape[2], window), (call.where, call.shape[2:], window)))
            continue
        done[key] = False
        cells = keep(call)
        if cells is None:
            continue
        top = run.top(call)
        own = queries(call, top)
        rows = by_row(cells, call.shape[0] if cells.shape[0] in (1, call.shape[0]) else None)
        real = resolve(call, top, rows)
        has, lo, hi, count, first, last, total = _spans(rows, real)
        keys = _positions(call, own, columns_are_positions(call, top, own))
        if (has & (keys[last] > own[None, :])).any():
            continue  # (a query sees a later key: not a one-sided window's mask)
        wide = has & (hi - lo + 1 > window + 1)
        if not wide.any():
            done[key] = True
            kept.update(((call.step, call.shape[2], window), (call.where, call.shape[2:], window)))
            continue
        b, q = first_cell(wide)
        a, z = int(keys[first[b, q]]), int(keys[last[b, q]])
        found.append((call, Finding("window-dropped", (
            f"{where}: a window of {window} holds {window} or {window + 1} keys by its convention, but query "
            f"{int(own[q])} of batch row {b} sees keys {a} .. {z}, a span of {int(hi[b, q] - lo[b, q] + 1)} real "
            f"keys ({int(wide.sum())} such rows; step {call.step}): the window is dropped on this path"),
            expected=f"window({window})", source=where, cell=(b, int(own[q]), a))))
    return [(call, f) for call, f in found if kept.isdisjoint((
        (call.step, call.shape[2], int(call.details["window_counted"][1])),
        (call.where, call.shape[2:], int(call.details["window_counted"][1]))))]


def _counted(run: Run) -> list:
    """A single query whose frame holds a plain int window W and its position p (trace/windows.py's window_counted)
    that sees fewer than min(W, p + 1) keys in every head: W is W keys or W + 1 by its convention, never fewer. Read on
    one batch row only (a row's padding would lower the count; its position says nothing of it) and where the call
    holds at least that many keys."""
    found, calls = [], {}
    for call in run.calls:
        calls[(call.where, call.step)] = calls.get((call.where, call.step), 0) + 1
    for call in run.calls:
        said = call.details.get("window_counted")
        if not said or len(said) != 4 or call.stored is None or call.shape[0] != 1 or call.shape[2] != 1:
            continue
        name, window, at, where = said[0], int(said[1]), int(said[2]), str(said[3])
        want = at + 1 if window < 0 else min(window, at + 1)
        cells = keep(call)
        if cells is None or (want > call.shape[3] and calls[(call.where, call.step)] > 1):
            continue  # (the step's keys split over several calls)
        seen = cells[..., 0, :].sum(axis=-1).reshape(-1)  # per head
        if seen.size == 0 or seen.min() != seen.max() or not 1 <= int(seen[0]) < want:
            continue
        if window > 0 and want > call.shape[3] and int(seen[0]) != call.shape[3]:
            continue  # (a window's keys not all held, and some of those held masked: not a cache sliced to the window)
        got = int(seen[0])
        if window < 0:
            found.append((call, Finding("keys-dropped", (
                f"{where}: the query at position {at} sees {got} key{'s' * (got != 1)} in every head (the call holds "
                f"{call.shape[3]}), but {name} = -1 states no window, so it sees every position 0 .. {at}, {want} keys "
                f"(step {call.step}): keys of a full layer freed or trimmed (a cache cut to another layer's window?)"),
                expected=f"{want} keys", source=where)))
            continue
        sliced = got == call.shape[3] < want  # (every key handed seen, fewer than the window: the keys cut short)
        found.append((call, Finding("window-narrower", (
            f"{where}: the query at position {at} sees {got} of the call's {call.shape[3]} keys in every head, but a "
            f"window of {window} holds {want} keys there ({window} or {window + 1} by its convention, never fewer; "
            f"step {call.step}): " + ("the keys handed to the call were cut to fewer than the window" if sliced else
                                      "the mask is a narrower window than held")),
            expected=f"{want} keys", source=where)))
    return found


def _shown(name: str, left: int, right: int) -> str:
    if name == "window_left" and right > 0:  # (a window_right beside it: trace/windows.py)
        return f"{left} and window_right = {right}"
    return str(left) if name in ("window_left", "sliding_window_size") else f"({left}, {right})"


def _reach(left: int, right: int) -> str:
    return f"p - {left} .. p" if right == 0 else f"p - {left} .. p + {right}"


RULES = (
    Rule("keys-dropped", "wrong", "call", "a single query whose frame holds window_size / sliding_window = -1 (no "
         "window) beside its position p and that sees fewer than p + 1 keys: a full layer's keys freed or trimmed",
         held_window),
    Rule("window-dropped", "wrong", "call", "a query that sees keys further apart than the one-sided or symmetric "
         "window (window_left, window_size=(L, 0), a layer's sliding_window_size) the program holds on the way to "
         "the kernel spans: a path that drops the window", held_window),
    Rule("window-narrower", "wrong", "call", "every uncut query sees fewer keys than the window the program holds on "
         "the way to the kernel: a kernel's exclusive bound handed an inclusive one, a mask built for another window",
         held_window),
)
