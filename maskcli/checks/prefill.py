"""Chunked prefill equals one pass: a prompt prefilled in chunks behind a growing cache, put back together.

A call site's successive calls of several queries each, whose queries continue one sequence (each chunk's
first query right after the last one's: the model call's cache_position / input_pos / position_ids where
given, else the keys growing by exactly the chunk, as a cache that keeps them does), are one prompt
prefilled in chunks, as `generate(prefill_chunk_size=...)`, vLLM and SGLang do. Laid on absolute positions
(each key column where the cache put it: position j where the keys reach the chunk's end, else the most
recent keys ending at its last query), their rows put together must be the mask one pass over the prompt
gives: the config's layer kind (causal, window(sliding_window), local(attention_chunk_size)) where a
config says it, else the first chunk's own shape carried on (causal, or the window it shows). A later chunk
whose queries see later keys, or miss keys of earlier chunks that one pass lets them see, is wrong. A call
handed the very queries an earlier call of its site attended (the same tensor, unchanged: trace/queried.py) is no
chunk: a cascade attends its new tokens to themselves and, again, to the cached prefix, and merges the two by their
log-sum-exp (LightLLM's, SGLang's); one pass is what the merge computes, not what either call shows. Keys
past a chunk's last query (a static cache's slots not yet written) are cache.py's; the first chunk is
checked alone by the other rules, and a group another rule already calls wrong is not told twice
(engine.py). `maskcli model` places its calls itself and checks `--prefill-chunk` against its own single
pass (hf/chunks.py): its calls are left to it.

The other way round (one-pass-sees-later): a program that attends a prompt in one pass and feeds the same token ids
(the model call's input_ids) again at the same site from an empty cache, step by step (an export checked against
token-by-token decoding), states by the steps what each query sees; a later key the one pass shows a real query and
no step does is the one pass's slip (torch-to-nnef#217: the causal mask sized from the cache's batch axis, [1, 1]).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.config import layer_kind
from maskcli.checks.context import DENSE_CELLS, Run, band, first_cell, found_padding, keep, layer, queries
from maskcli.checks.boundaries import _index
from maskcli.checks.real import read_off, stated
from maskcli.checks.own import repeated
from maskcli.checks.tree import siblings
from maskcli.checks.registry import Rule
from maskcli.keypadding import options
from maskcli.text import Finding


def key_positions(call, own: np.ndarray) -> np.ndarray:
    """Each key column's absolute position: position j where the keys reach the last query (a cache that keeps every
    key, or a static one), else the most recent keys ending there (a sliding cache, or the chunk's own keys)."""
    k_len, last = call.shape[3], int(own[-1])
    return np.arange(k_len) if k_len > last else np.arange(last + 1 - k_len, last + 1)


def runs(run: Run, calls: list) -> list[list]:
    """The call site's prefill chunks: runs of at least two calls of several queries, (call, queries, keys) each, the
    first from position 0, each continuing the one before it."""
    found, current, handed = [], [], set()
    for call in calls:
        if call.details.get("queries") is not None:
            return []  # placed by `model`, whose --prefill-chunk checks its chunks against its own single pass
        own = queries(call, run.top(call))
        keys = key_positions(call, own) if call.shape[2] > 1 and (np.diff(own) == 1).all() else None
        same = _handed(call)
        if same is not None and same in handed:
            keys = None  # queries an earlier call attended already (a cascade's other part): no prompt's next chunk
        handed.add(same)
        continues = bool(current) and own.size > 0 and int(own[0]) == int(current[-1][1][-1]) + 1 and call.shape[:2] == current[-1][0].shape[:2]
        if continues and repeated(run, current[-1][0], call):
            continues = False  # the same queries again, the earlier mask kept (a draft's test-time steps): no chunk
        if keys is not None and siblings(call, own, keys):
            keys = None  # queries that see none of each other: a draft tree's depth of siblings (tree.py), no chunk
        if keys is not None and continues and _compressed(run, current[-1][0], call, own):
            keys = None  # a cache that kept some of the earlier keys, no window said: its columns are no positions
        if keys is not None and continues:
            current.append((call, own, keys))
            continue
        if len(current) > 1:
            found.append(current)
        current = [(call, own, keys)] if keys is not None and own[0] == 0 else []
    return found + ([current] if len(current) > 1 else [])


def _compressed(run: Run, before, call, own: np.ndarray) -> bool:
    """Whether `call` holds fewer earlier keys than its site's call `before` had, yet some (a cache compressed between
    steps: kvpress' presses, SnapKV's selection), where neither the config nor `before`'s rows state a window: which
    positions the kept columns hold the mask does not say (a chunk of its own keys alone, a ring under a window, are
    read as before)."""
    held = call.shape[3] - call.shape[2]
    if call.shape[3] > own[-1] or not 0 < held < before.shape[3]:
        return False
    kind = layer_kind(run.config(before), _index(before, run.config(before)))
    cells = keep(before)
    return (kind is None or kind[0] == "full_attention") and cells is not None and _window(cells.any(axis=1)) is None


def _handed(call):
    """The query tensor the kernel was handed, comparable between calls (trace/queried.py's query_tensor); None where
    not recorded."""
    given = call.details.get("query_tensor")
    return None if given is None else repr(given)


def together(chunks: list) -> np.ndarray | None:
    """Bool (B, P, P): the chunks' rows on absolute positions (over the heads), keys past each chunk's last query left
    out; None where a chunk's mask is not kept or the prompt is too long to lay out cell by cell."""
    prompt = int(chunks[-1][1][-1]) + 1
    batch = chunks[0][0].shape[0]
    if batch * prompt * prompt > DENSE_CELLS:
        return None
    out = np.zeros((batch, prompt, prompt), dtype=bool)
    for call, own, keys in chunks:
        cells = keep(call)
        if cells is None:
            return None
        cells = np.broadcast_to(cells.any(axis=1), (batch, *cells.shape[2:]))
        inside = (keys >= 0) & (keys <= own[-1])
        rows = out[:, own[0]:own[-1] + 1]
        rows[..., keys[inside]] = cells[..., np.flatnonzero(inside)]
    return out


def _built(expression: str, prompt: int, padding: dict) -> np.ndarray | None:
    """Bool (B or 1, P, P) of `expression` over the prompt with the padding found; None where it does not build."""
    from maskcli.errors import MaskError
    from maskcli.mask import MaskOptions, build

    try:
        return build(expression, MaskOptions(length=prompt, **padding)).dense().any(axis=1)
    except MaskError:
        return None


def _window(rows: np.ndarray) -> int | None:
    """W, the most keys a row of positions 0.. sees, where a row past W sees W (a window that cuts: one pass would show
    it); else None. Whether the rows are that window is for the comparison to say."""
    count = rows.sum(axis=-1)
    width = int(count.max(initial=0))
    return width if width > 0 and (count[:, width:] == width).any() else None


def expectation(first, chunks: list, union: np.ndarray, config) -> tuple[str, str] | None:
    """(expression, where it comes from) of the one-pass mask: the config's layer kind, else the first chunk's shape."""
    index = _index(first, config)
    kind = layer_kind(config, index)
    if kind is not None:
        name, field = kind
        expressions = {"full_attention": "causal", "sliding_attention": f"window({getattr(config, 'sliding_window', 0)})",
                       "chunked_attention": f"local({getattr(config, 'attention_chunk_size', 0)})"}
        return (expressions[name], f"config ({field})") if name in expressions else None
    head = union[:, :len(chunks[0][1])]
    width = _window(head)
    return ("causal", "its first chunk") if width is None else (f"window({width})", "its first chunk")


SPANS = ("token_type_ids", "mm_token_type_ids")  # image spans one pass sees both ways: a mask no kind here rebuilds


def _differ(union: np.ndarray, cells: np.ndarray, chunks: list) -> np.ndarray:
    """Bool (B, P, P): where the chunks put together part from one pass, leaving out keys a query misses inside its own
    chunk (a speculative tree's verification step masks those, and no chunking bug does: it drops earlier chunks'
    keys, or lets a chunk see later ones)."""
    start = np.zeros(union.shape[-1], dtype=np.int64)
    for _, own, _ in chunks:
        start[own[0]:own[-1] + 1] = own[0]
    inside = np.arange(union.shape[-1])[None, :] >= start[:, None]
    return (cells != union) & ~(cells & ~union & inside) & ~_withdrawn(union, chunks)


def _withdrawn(union: np.ndarray, chunks: list) -> np.ndarray:
    """Bool (B, P, P): a batch row's earlier keys that a chunk hides from every one of its queries while another row
    of the same call sees them: keys taken out of that row's cache on purpose, per row (a speculative verify's
    rejected drafts past the row's accepted length, with the cache rolled back only to the batch's longest), not a
    chunking slip, which builds every row's rows alike."""
    out = np.zeros(union.shape, dtype=bool)
    for _, own, _ in chunks:
        rows = union[:, own[0]:own[-1] + 1, :own[0]].any(axis=1)  # (B, keys before the chunk) seen by any query
        hidden = ~rows & rows.any(axis=0, keepdims=True)
        out[:, own[0]:own[-1] + 1, :own[0]] = hidden[:, None, :]
    return out


def _misplaced(union: np.ndarray) -> np.ndarray:
    """Bool (B, 1, 1): batch rows where a query that sees some key misses its own column: its queries are not where the
    chunk's layout puts them (RETURNN's state joined per row, a short first chunk's row packed before the next chunk's
    frames, so that row's queries end before the call's keys do); one pass is not compared on those rows."""
    diagonal = np.diagonal(union, axis1=1, axis2=2)  # (B, P)
    return (union.any(axis=2) & ~diagonal).any(axis=1)[:, None, None]


def _real(run: Run, chunks: list, union: np.ndarray) -> np.ndarray:
    """Bool (B, P): the prompt's real tokens, as its last chunk's model call states them, else read off the chunks put
    together (checks/real.py)."""
    rows, prompt = union.shape[0], union.shape[-1]
    said = stated(run.top(chunks[-1][0]), rows, prompt)
    if said is not None:
        return said[0]
    return read_off(union, np.arange(prompt))[0]


def _one_pass(run: Run, chunks: list, union: np.ndarray) -> tuple[str, str, np.ndarray, np.ndarray] | None:
    """(expression, where it comes from, its cells (B, P, P), the chunks' cells on real query rows) of the one-pass mask where the first chunk is that mask's
    rows; None where it is not known, or the chunks put together are it (or, from the first chunk alone, a window
    wider than it: a first chunk shorter than the window is causal)."""
    first = chunks[0][0]
    config = run.config(first)
    tops = [top for top in (run.top(call) for call, _, _ in chunks) if top is not None]
    if getattr(config, "is_encoder_decoder", False) or any(np.any(top.arguments.get(name, 0)) for top in tops for name in SPANS):
        return None
    real = _real(run, chunks, union)
    union = union & real[:, :, None]  # padding query rows are not read (they may see every key: no NaN)
    expected = expectation(first, chunks, union, config)
    padding = options(real) if (~real).any() else found_padding(union[:, None])
    cells = None if expected is None else _built(expected[0], union.shape[-1], padding)
    if cells is None or cells.shape[0] not in (1, union.shape[0]):
        return None
    cells = np.broadcast_to(cells, union.shape) & real[:, :, None]
    head = len(chunks[0][1])
    if np.array_equal(cells, union) or not np.array_equal(cells[:, :head], union[:, :head]):
        return None  # the same; or the first chunk differs already, which a rule that reads one call says
    if expected == ("causal", "its first chunk") and (width := _window(union)) is not None:
        window = _built(f"window({width})", union.shape[-1], padding)
        if window is not None and np.array_equal(np.broadcast_to(window, union.shape), union):
            return None
    return (*expected, cells, union)


def _sites(run: Run) -> list[list]:
    """Each call site's calls; a site called from two lines that take turns (A, B, A: a helper the layer calls to attend
    to itself and then to a memory, joeynmt's `mha(x, x, x)` then `mha(x, mem, mem)` re-run over the whole prefix each
    step) is one site a line. A prompt's chunks may come from other lines one after the other (a prefill, then a
    verification), never back and forth."""
    found = []
    for calls in run.sites().values():
        lines = [call.details.get("caller") for call in calls]
        turns = [line for n, line in enumerate(lines) if n == 0 or line != lines[n - 1]]
        if len(turns) == len(set(turns)):
            found.append(calls)
            continue
        for line in dict.fromkeys(lines):
            found.append([call for call in calls if call.details.get("caller") == line])
    return found


def chunked(run: Run) -> list:
    """A prompt prefilled in chunks whose masks put together differ from one pass over it."""
    found = []
    for calls in _sites(run):
        if sum(call.shape[2] > 1 for call in calls) < 2:
            continue  # one prefill and its decode steps: no chunks (most runs stop here)
        top = run.top(calls[0])
        if top is not None and any("mem_len" in one.fields for one in top.stated):
            continue  # a recurrent-memory model's segments (checks/memlen.py): by design no one pass over them
        for chunks in runs(run, calls):
            union = together(chunks)
            expected = None if union is None else _one_pass(run, chunks, union)
            if expected is not None:
                union = expected[3]  # (its padding query rows left out)
            differ = None if expected is None else _differ(union, expected[2], chunks) & ~_misplaced(union)
            if differ is None or not differ.any():
                continue
            b, q, k = first_cell(differ)
            call, own, _ = next(chunk for chunk in chunks if chunk[1][0] <= q <= chunk[1][-1])
            what = (f"sees key {k}, later than itself" if k > q else f"sees key {k}, which one pass masks") if union[b, q, k] \
                else f"misses key {k}{' of an earlier chunk' if k < own[0] else ''}, which one pass lets it see"
            found.append((call, Finding("prefill-chunks-differ", (
                f"prefilled in {len(chunks)} chunks, the {union.shape[-1]}-token prompt differs from one pass "
                f"({expected[0]}, from {expected[1]}) in {int(differ.sum())} cells: query {q} of batch row {b} {what} "
                f"(step {call.step})"),
                expected=expected[0], source=f"one pass over the prompt; {expected[0]} from {expected[1]}", cell=(b, q, k))))
    return found


IDS = ("input_ids", "idx", "tokens")  # the model call's token ids, batch-major (trace/tops.py keeps them)


def _ids(top, call=None) -> np.ndarray | None:
    """(B, L) token ids the model call was handed; where it was handed none (a model's own method, such as
    `forward_trunk(tokens, cache)`, called directly: the outermost module calls are its layers), the 2-D token ids the
    function that holds `call`'s mask was handed (trace/held.py's kind "ids"); None where neither states any."""
    arguments = {} if top is None else top.arguments
    given = next((arguments[n] for n in IDS if isinstance(arguments.get(n), np.ndarray) and arguments[n].ndim == 2), None)
    if given is not None or call is None:
        return given
    return next((held["rows"] for held in call.details.get("held_padding") or () if held["kind"] == "ids"
                 and isinstance(held["rows"], np.ndarray) and held["rows"].ndim == 2), None)


def _slots(run: Run, calls: list) -> list[list]:
    """A call site's calls by their place among the site's calls of their model call (a module that runs every layer
    at one site: its first call is layer 0 at every step), each in step order."""
    slots, seen = [], {}
    for call in calls:
        top = run.top(call)
        made = id(top) if top is not None else ("step", call.step)  # (no module call: the step stands for it)
        at = seen[made] = seen.get(made, -1) + 1
        while len(slots) <= at:
            slots.append([])
        slots[at].append(call)
    return slots


def _stepped(run: Run, calls: list) -> list[tuple[list, np.ndarray]]:
    """Runs of calls that feed one prompt from an empty cache (the first call's queries from position 0, every call's
    keys exactly the positions up to its last query, each continuing the one before), at least two, with their model
    calls' token ids put together: ([(call, queries, keys)], ids (B, P))."""
    found, current, ids = [], [], []
    for call in calls + [None]:
        top = None if call is None else run.top(call)
        own = None if call is None else queries(call, top)
        given = _ids(top, call)
        ok = own is not None and given is not None and given.shape[-1] == call.shape[2] and call.shape[3] == own[-1] + 1 \
            and (np.diff(own) == 1).all()
        if ok and current and int(own[0]) == int(current[-1][1][-1]) + 1 and call.shape[:2] == current[-1][0].shape[:2] \
                and given.shape[0] == ids[-1].shape[0]:
            current.append((call, own, np.arange(call.shape[3])))
            ids.append(given)
            continue
        if len(current) > 1:
            found.append((current, np.concatenate(ids, axis=1)))
        current, ids = ([(call, own, np.arange(call.shape[3]))], [given]) if ok and own[0] == 0 else ([], [])
    return found


def repassed(run: Run) -> list:
    """A prompt the program attends in one pass and again, from an empty cache, in steps over the same token ids at the
    same call site (an export checked against token-by-token decoding): where the one pass lets a query see a later
    key, which the steps, the program's own reading of the same tokens, never show it."""
    found, sites = [], {}
    for call in [*run.calls, *run.unmasked]:  # (a site that masks nowhere, its one pass full: engine.py's unmasked)
        if call.stored is not None:
            sites.setdefault(call.where, []).append(call)
    for calls in sites.values():
        if len(calls) < 3 or not any(call.shape[2] > 1 for call in calls) \
                or sum(run.placed(call)[1][:1].tolist() == [0] for call in calls) < 2:
            continue  # (the one pass and the steps' first chunk both start at position 0: a site with one such call
            # has no prompt read twice)
        calls.sort(key=lambda call: call.index)
        for slot in _slots(run, calls):
            for chunks, ids in _stepped(run, slot):
                if len(chunks) < 3:
                    continue
                steps = together(chunks)
                for call in slot:
                    hit = None if steps is None else _later(run, call, chunks, ids, steps)
                    if hit is not None:
                        found.append((call, hit))
                        break
    return found


def _later(run: Run, call, chunks: list, ids: np.ndarray, steps: np.ndarray) -> Finding | None:
    """The one pass `call` over the stepped prompt's first tokens, where a query sees a later key the steps keep real."""
    length = call.shape[2]
    top = run.top(call)
    if length < 2 or call.shape[3] != length or any(call is chunk[0] for chunk in chunks) or length > ids.shape[1]:
        return None
    given = _ids(top, call)
    if given is None or given.shape != (ids.shape[0], length) or not np.array_equal(given, ids[:, :length]) \
            or not np.array_equal(queries(call, top), np.arange(length)):
        return None
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, ids.shape[0]) or steps.shape[0] not in (1, ids.shape[0]):
        return None  # (steps over rows the ids do not number: MusicGen's codebooks folded into the batch)
    one = np.broadcast_to(cells.any(axis=1), (ids.shape[0], length, length))
    real = steps[:, :length, :length].any(axis=1)  # (B, keys): keys some step shows (its real tokens)
    later = one & ~steps[:, :length, :length] & band(length, length, 1, True) & real[:, None, :] \
        & real[:, :, None]  # (later keys a step's own block shows too: a block both ways, as the one pass has it)
    if not later.any():
        return None
    b, q, k = first_cell(later)
    return Finding("one-pass-sees-later", (
        f"query {q} of batch row {b} sees later key {k} in one pass over the {length}-token prompt (step {call.step}), "
        f"but the same call site fed the same token ids again from an empty cache in {len(chunks)} steps (steps "
        f"{chunks[0][0].step}-{chunks[-1][0].step}), which never show a query a later key: {int(later.sum())} such "
        f"cells (the one pass has lost its causal mask)"),
        expected="causal, as the steps over the same tokens", source=f"the same site's steps {chunks[0][0].step}-"
        f"{chunks[-1][0].step} over the same token ids", cell=(b, q, k))


RULES = (
    Rule("one-pass-sees-later", "wrong", "site", "a prompt attended in one pass whose queries see later keys, where "
         "the same site fed the same token ids again from an empty cache, step by step (torch-to-nnef#217: an export's "
         "causal mask sized from the cache's batch axis, a [1, 1] mask)", repassed),
    Rule("prefill-chunks-differ", "wrong", "site", "a prompt prefilled in chunks behind a cache whose masks put together "
         "differ from one pass over it (a chunk that misses earlier chunks' keys or sees later ones)", chunked),
)
