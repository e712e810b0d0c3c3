"""An engine's per-request attention over another number of keys than its own metadata states for that request.

Serving engines run a batch of requests through one forward and hand their attention a metadata object that states
each request's new tokens (`q_cu_seq_lens`, `cu_seqlens_q`, `query_start_loc`) and its keys, cached ones included
(`kv_seq_lens`, `seq_lens`, `b_seq_len`, `cu_seqlens_k`), read from the program's frames by trace/reqlens.py. Where
the calls made under one such statement are one per request (a kernel port looping over the batch, or a per-request
backend), batch row 1 each (or its heads on the batch axis), their query counts those the metadata states in its
order, each request's call must be
handed the keys it states: fewer, and the request's queries never see its cached prefix (xLLM#2161: the prefill of a
prefix-cache hit attends only its new tokens); more, and its queries see keys past its own (stale slots, or another
request's). The kernel's own arguments (the frame's variables) are what is checked, not what states: a kernel handed
the per-token lengths of an expanded verify batch in place of the per-request ones (LightLLM#1338) reads other counts.
Quiet where the program states a window (a rolling buffer keeps fewer keys than the request has), where the calls
under one statement are not one per request in its order (a cascade's prefix and suffix parts, a batched call), and
where two of the metadata's key statements for as many requests disagree (trace/reqlens.py states none then).
"""

from __future__ import annotations

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

CODE = "request-keys-differ"
WINDOWS = ("sliding_window", "window_size", "sliding_window_size", "attention_chunk_size", "layer_types")


def one_sequence(call, alike: bool = True) -> bool:
    """A call over one sequence: batch 1, or its heads laid on the batch axis (a flash stand-in's (H, 1, L, L), or a
    (q, h, k) einsum's scores read as (h, 1, q, k)): one head a row, the heads' count stated, or (`alike`) every row's
    cells alike."""
    if call.shape[0] == 1:
        return True
    if call.shape[1] != 1:
        return False
    heads = call.details.get("stated_heads") or call.details.get("own_heads")
    if heads == call.shape[0]:
        return True
    if not alike:
        return False
    cells = keep(call)
    return cells is not None and bool((cells == cells[:1]).all())


def _statement(call):
    said = call.details.get("request_lengths")
    if not isinstance(said, dict):
        return None
    return (tuple(said["queries"][1]), tuple(said["keys"][1]), said["keys"][0])


def _windowed(run: Run, call) -> bool:
    """The program states a window for this call: its frames hand one, or a config it states has one."""
    if call.details.get("window_handed") is not None or call.details["request_lengths"].get("window"):
        return True
    top = run.top(call)
    stated = () if top is None else top.stated
    return any(_a_window(one.fields.get(name), name == "layer_types") for one in stated for name in WINDOWS)


def _a_window(value, kinds: bool = False) -> bool:
    """A config field that states some window: a size above 0 (a NaN, a negative or a word is none), or a list of
    them; with `kinds` (layer_types), a list of layer kinds one of which is not full attention."""
    if isinstance(value, (list, tuple)):
        return any(_a_window(one) or kinds and isinstance(one, str) and one not in ("full_attention", "full", "global")
                   for one in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def _groups(run: Run) -> list[tuple[tuple, list]]:
    """Runs of consecutive calls made under one statement (the same lengths from the same field)."""
    found, last = [], None
    for call in run.calls:
        said = _statement(call)
        if said is None:
            last = None
            continue
        if last is not None and last[0] == said:
            last[1].append(call)
        else:
            last = (said, [call])
            found.append(last)
    return found


def requests(run: Run) -> list[tuple]:
    """(call, request, its stated keys, the statement's source) of every call that is one request's of a statement
    made one call per request, in its order (read once per run)."""
    held = run.__dict__.get("_requests")
    if held is not None and held[0] == (id(run.calls), len(run.calls)):
        return held[1]
    found = []
    for (queries, keys, source), calls in _groups(run):
        count = len(queries)
        if len(calls) % count or any(not one_sequence(call) or call.shape[2] != queries[i % count]
                                     for i, call in enumerate(calls)):
            continue  # (not one call per request in the statement's order: nothing says which call is which request)
        found += [(call, i % count, keys[i % count], source) for i, call in enumerate(calls)]
    run.__dict__["_requests"] = ((id(run.calls), len(run.calls)), found)
    return found


def stated_first(run: Run) -> dict[int, int]:
    """call index -> the position of its first query that the engine's metadata states (the request's keys less its
    new tokens), for calls one per request: a paged call handed whole blocks whose queries are a request's first
    tokens sits at 0, its later slots unwritten (steps.py's top-left-mask reads it)."""
    return {call.index: stated - call.shape[2] for call, _, stated, _ in requests(run)}


def request_keys(run: Run) -> list:
    """The calls, one per request in the metadata's order, whose keys differ from the request's stated key count."""
    found = []
    for call, request, stated, source in requests(run):
        k_len = call.shape[3]
        if k_len == stated or k_len < stated and _windowed(run, call):
            continue
        if k_len > stated:
            cells = keep(call)
            if cells is None:
                continue
            seen = int(cells[:, :, -1].any(axis=(0, 1)).sum())  # (the request's last query: every key it attends)
            if seen <= stated:
                continue  # (a padded buffer whose slots past the request's keys are masked)
            said = f"its last query sees {seen} keys"
            why = "keys past the request's own (stale slots, or another request's)"
        else:
            said = f"it is handed {k_len} keys"
            why = "the request's other keys (its cached prefix) left out, or its count read from another field"
        queries = f"{call.shape[2]} quer{'y' if call.shape[2] == 1 else 'ies'}"
        found.append((call, Finding(CODE, (
            f"request {request} of the batch ({queries}): {said} where {source} states {stated}: {why}"),
            expected=f"{stated} keys for request {request}", source=source)))
    return found


RULES = (
    Rule(CODE, "wrong", "steps", "an engine's attention for one request of its batch is handed (or sees) another number "
         "of keys than the engine's own metadata states for that request (kv_seq_lens, seq_lens, cu_seqlens_k)",
         request_keys),
)
