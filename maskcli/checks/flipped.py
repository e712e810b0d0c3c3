"""A cached token whose padding flips: called real, then padding, then real again behind one cache.

A token's key, once cached, stays the same token at the same column while the steps of a call site run on behind
the cache; whether it is padding does not change either. The model call states it at every step (its
attention_mask, over every cached column: checks/real.stated). A column the model call calls real at one step (its
real queries seeing it), padding at a later one (its real queries hiding it), and real again after (seen again)
states the same cached token both ways: the mask of the step between is laid over other columns than the cache's
(transformers#29850: LLaVA-NeXT rebuilt each cached step's mask from the text mask, its image's expanded columns
appended and the pads found among those, so a left-padded row hid 4 real keys inside its prompt, a different 4 at
each step). A cache that evicts by masking hides a key for good, never again, and a mask that chooses its keys (top-k
selection) is no padding the model call states. Read per batch row over columns before the step's first query, only
while the site's steps keep the same batch rows and their keys grow from the prefill's; one finding a site.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.real import stated_once
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

UNKNOWN, REAL, HIDDEN, AGAIN = 0, 1, 2, 3


def _step(call, top, own: np.ndarray, prefill: bool, memo: dict) -> tuple | None:
    """(stated real (B, Lk), seen by the row's real queries (B, Lk), the argument that states it, bool (B, Lq) the real
    queries) of one call; at a prefill whose model call states no padding over its keys (LLaVA's, stated over the text
    before the image is expanded), its queries that see their own key are its real ones and the keys they see real."""
    cells = keep(call)
    batch, _, q_len, k_len = call.shape
    said = stated_once(memo, top, batch, k_len)  # (every layer of one model call asks the same)
    if cells is None or said is None and not prefill or len(own) != q_len or own.min() < 0 or own.max() >= k_len:
        return None
    seen = np.broadcast_to(cells.any(axis=1), (batch, q_len, k_len))
    real = np.broadcast_to(said[0] if said is not None else np.ones((1, k_len), bool), (batch, k_len))
    asking = seen[:, np.arange(q_len), own] & real[:, own]  # (B, Lq): real queries that see their own key
    return real, (seen & asking[:, :, None]).any(axis=1), None if said is None else said[1], asking


def flipped(run: Run) -> list:
    """Each call site's first cached column that its model calls state real, padding, then real again."""
    found, memo = [], {}
    for where, calls in run.sites().items():
        state = None
        for call in calls:
            top, own, positions = run.placed(call)
            if top is None or cross(call) or not positions:
                state = None
                continue
            own = np.asarray(own)
            if own.size == 0 or call.shape[3] == 0:
                continue  # (attention over no token: nothing cached, nothing stated)
            prefill = call.shape[2] == call.shape[3] and own[0] == 0  # (the site's sequence begins)
            read = _step(call, top, own, prefill, memo)
            if read is None:
                continue
            real, seen, name, asking = read
            batch, k_len = real.shape
            if prefill:
                state = _begin(real, seen, own, call)
                continue
            if state is None or state["rows"] != batch or k_len < state["keys"]:
                state = None
                continue
            hit = _advance(state, real, seen, asking, own, call, name)
            if hit is not None:
                found.append(hit)
                break
    return found


def _begin(real: np.ndarray, seen: np.ndarray, own: np.ndarray, call) -> dict:
    """A prefill's columns: those its real queries see and the model call calls real."""
    marks = np.where(real & seen, REAL, UNKNOWN).astype(np.int8)
    return {"rows": real.shape[0], "keys": real.shape[1], "marks": marks, "first": call.step,
            "hider": np.full(real.shape, -1, np.int32), "hiders": []}


def _advance(state: dict, real: np.ndarray, seen: np.ndarray, asking: np.ndarray, own: np.ndarray, call,
             name: str) -> tuple | None:
    """One cached step: each column before its first query moves REAL -> HIDDEN (called padding, hidden) -> AGAIN
    (called real, seen again); (the call that hid it, the finding) where one gets there. Whole arrays a step: no loop
    over the columns."""
    batch, k_len = real.shape
    marks, hider = np.zeros((batch, k_len), np.int8), np.full((batch, k_len), -1, np.int32)
    marks[:, :state["keys"]], hider[:, :state["keys"]] = state["marks"], state["hider"]
    cached = np.arange(k_len)[None, :] < int(own.min())
    judged = asking.any(axis=1)[:, None] & cached  # (a row with no real query says nothing of its keys)
    hidden = judged & (marks == REAL) & ~real & ~seen
    again = judged & (marks == HIDDEN) & real & seen
    fresh = judged & (marks == UNKNOWN) & real & seen
    if hidden.any():  # (the step that hid them, and each row's first real query there)
        hider[hidden] = len(state["hiders"])
        state["hiders"].append((call, own[np.argmax(asking, axis=1)]))
    marks[hidden], marks[again], marks[fresh] = HIDDEN, AGAIN, REAL
    state.update(keys=k_len, marks=marks, hider=hider)
    if not again.any():
        return None
    b, k = (int(x) for x in np.argwhere(again)[0])
    at = int(hider[b, k])
    hid, queries = state["hiders"][at]
    gone = np.flatnonzero(hider[b] == at)
    return hid, Finding("padding-flipped", (
        f"batch row {b}: key {k}, a cached token the row's queries saw at step {state['first']}, is called padding by "
        f"the model call's {name} and hidden at step {hid.step} (keys {spans(gone.tolist())} there), then called real "
        f"and seen again at step {call.step}: the token in the cache did not change, its padding did (the step's mask "
        f"laid over other columns than the cache's?)"),
        expected=f"key {k} real at every step", source=f"{name} of the model call at step {hid.step}",
        cell=(b, int(queries[b]), k))


RULES = (
    Rule("padding-flipped", "wrong", "site", "a cached token the model call states real, then padding (hidden), then "
         "real again at a later step behind the same cache: the mask of the step between laid over other columns",
         flipped),
)
