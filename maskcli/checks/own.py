"""What the attention states of itself: its module's causal flag, its sibling layers' masks, its own earlier step.

- A module whose own attribute says it is causal (`self.causal = True`, `self.is_causal = True`: trace records it
  on each call the module makes, trace/sites.py causal_flag) but whose softmax or kernel over square (L, L) scores
  masks nothing at all on the real queries and keys: the flag never reached the mask (xformers#103: the causal mask
  merged only where an extra att_mask was passed). Over fewer queries than keys that the one reading of
  cross-attention (checks/context.crossing) does not call another sequence's, the queries sit at the end of the keys
  (a memory, a look-back bucket before them) and a real query that sees any later key contradicts the flag
  (local-attention#5: causal and exact_windowsize AND-ed, so every bucket saw its own future). Left alone: a call
  made through a transformers attention interface (its mask is masking_utils', built from the config; the module's
  flag is read only where no mask is given), later keys its model call's token types account for (PaliGemma's prefix
  at prefill), a config that states the attention both ways (the flag disagrees with the config, not with the mask),
  one query.
- A full-attention layer (by the config's layer kinds) that is causal in a model call whose sliding layers see a
  symmetric window (`|q - k| < W`): the program attends both ways, and a full layer sees at least what a sliding
  one does (transformers#42820: T5Gemma2's encoder attention flagged is_causal, so SDPA ran it causal where the
  all-ones padding mask was shortcut to None).
- A call site whose step t keeps step t-1's mask as its first columns and appends one key per query (the same
  queries again: a draft model's training-time test, EAGLE-3): the appended keys are the queries' positions once
  more, so a query may see the new key of a position only where its own step-0 mask lets it see that position
  (speculators#897: a 1/0 block appended to an additive 0/-inf mask, every draft key seen by every query).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.callcausal import said_both_ways
from maskcli.checks.config import _each_layer_call, _layer, _placed
from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.intent import intent
from maskcli.checks.registry import Rule
from maskcli.checks.spans import explained
from maskcli.checks.tiled import positions
from maskcli.text import Finding, spans

POSITIONS = ("cache_position", "input_pos", "position_ids")  # a model call's word on where its queries are


def _word(said: str) -> str:
    """`causal=True` of a module's attribute flag ('Class.causal'), `attn_mask_type=causal` of its mask type's
    ('Class.attn_mask_type=causal': trace/sites.py), `forward(is_causal=True)` of a forward argument's
    ('Class.forward(is_causal=True)': trace/forwardflag.py)."""
    tail = said.split(".", 1)[-1]
    return tail if said.endswith(")") or "=" in tail else f"{said.split('.')[-1]}=True"


def flag_ignored(run: Run) -> list:
    """A module that states itself causal whose square scores are masked nowhere (on real queries and keys)."""
    candidates = [(call, call.details.get("module_causal") or _model_flag(run, call)) for call in run.calls
                  if call.details.get("hf") is None and call.stored is not None and 1 < call.shape[2] <= call.shape[3]
                  and call.details.get("slots") is None
                  and (call.shape[2] == call.shape[3] or not cross(call))]
    candidates = [(call, said) for call, said in candidates if said and not said_both_ways(run.top(call))
                  and (call.details.get("call_causal") or {}).get("causal") is not False]
    # (a model call handed is_causal=False overrides its modules' own flag, as does a helper the program calls with a
    # literal causal=False at this call, trace/calledflag.py: checks/callcausal.py reads both)
    if not candidates:
        return []  # (most runs: no module says it is causal, or every call of one is transformers')
    judged, found, done = explained(run), [], set()
    for call, said in candidates:
        key = (call.mask, call.shape, said)
        if key in done or call.index in judged:
            continue
        done.add(key)
        stated = intent(run, call)
        if stated and stated.bidirectional() is not None or one_chunk(run, call):
            continue
        cells = keep(call)
        placed = None if cells is None else _placed(call, run, cells)
        # (square scores: only a mask that masks nothing is sure; fewer queries than keys, placed as the last keys
        # where the one reading says they are no other sequence's: a later key seen at all contradicts the flag)
        square = call.shape[2] == call.shape[3]
        if placed is None or (square and not placed.holds("full")) or placed.holds("causal") \
                or not square and regained(placed):
            continue
        own, keys = positions(call, placed.own, placed.keys)  # (one tile of a blockwise loop: at its place, tiled.py)
        later = placed.seen & placed.judged & (keys[None, :] > own[:, None])[None, None]
        if not later.any():
            continue
        b, _, q, k = first_cell(later)
        k = int(keys[k])
        found.append((call, Finding("causal-flag-ignored", (
            f"{_layer(None, call)}'s {'module' if call.details.get('module_causal') else 'model'} states {_word(said)} ({said}), but its {call.api} over "
            f"({call.shape[2]}, {call.shape[3]}) scores "
            f"{'masks nothing' if square else 'let a real query see a later key'}: "
            f"query {int(own[q])} sees later key {k} "
            f"({int(later.any(axis=1).sum())} such cells): the flag never reached the mask"
            f"{'' if square else ', or not all of it'}"),
            expected="causal", source=said, cell=(b, int(own[q]), k))))
    return found


def regained(placed) -> bool:
    """Placed with its queries as the last keys, a key before every query that a real query does not see and a later
    real query sees: no mask of queries after their keys does that (a window, documents, chunks, padding lose an earlier
    key for good), so the queries are not where they were placed (reformer's LSH chunks, keys = [own bucket, the bucket
    looked back to], sorted by hash: the first keys are the queries' own, under a causal staircase)."""
    before = placed.keys < placed.own.min()
    if not before.any():
        return False
    seen, judged = np.broadcast_arrays(placed.seen[..., before], placed.judged[..., before])
    hidden = np.logical_or.accumulate(~seen & judged, axis=2)
    return bool((seen[:, :, 1:] & judged[:, :, 1:] & hidden[:, :, :-1]).any())


def _model_flag(run: Run, call) -> str | None:
    """'Model.causal' where the outermost module states itself causal (trace/stated.py's model_causal: its own
    `self.causal = True`) and `call` is one of its square self-attentions whose own module says nothing either way:
    the model's word is then the layer's (speechbrain#2182: TransformerASR(causal=True) built no mask for its encoder,
    the decoder's look-ahead mask alone was made)."""
    if call.details.get("module_not_causal") or call.shape[2] != call.shape[3] or cross(call):
        return None
    top = run.top(call)
    said = None if top is None else next((one for one in top.stated if one.fields.get("model_causal")), None)
    if said is None:
        return None
    name = said.source.split("=", 1)[0].removeprefix("self.")  # "self.causal=True of TransformerASR"
    return f"{said.source.rsplit(' of ', 1)[-1]}.{name}"


def one_chunk(run: Run, call) -> bool:
    """The model states chunk sizes beside its causal flag (trace/chunksizes.py: a streaming encoder, causal meaning
    chunk-causal) of which one spans the call's queries, or -1 / 0 (the whole utterance): its queries may be one chunk,
    which sees itself whole (icefall's Zipformer streaming one chunk of 8 frames with chunk_size=(8,); dropped.py's
    causal-config-ignored asks too)."""
    top = run.top(call)
    said = None if top is None else next((one for one in top.stated if one.fields.get("model_chunks")), None)
    return said is not None and any(size <= 0 or size >= call.shape[2] for size in said.fields["model_chunks"][0])


def full_narrower(run: Run) -> list:
    """A full layer run causal beside sliding layers of the same model call that see a symmetric window."""
    layers = [one for one in _each_layer_call(run) if one[3] is not None and one[0].shape[2] == one[0].shape[3] > 1]
    both: dict = {}  # (model call, shape) -> the sliding layer whose mask sees both ways, with its window
    for call, stated, index, kind, placed in layers:
        window = stated.window()
        if kind[0] != "sliding_attention" or window is None or placed.holds("causal"):
            continue
        size = next((w for w in (window[0], window[0] + 1) if placed.holds(f"band({w})")), None)
        if size is not None and size > 1:  # (band(1): each query its own key alone, which sees neither way)
            both.setdefault((id(run.top(call)), call.shape), (index, call, size, stated.said(window[1])))
    if not both:
        return []
    found, done = [], set()
    for call, stated, index, kind, placed in layers:
        sliding = both.get((id(run.top(call)), call.shape))
        if kind[0] != "full_attention" or sliding is None or placed.holds("full") or not placed.holds("causal"):
            continue
        if (call.mask, call.shape, index) in done:
            continue
        done.add((call.mask, call.shape, index))
        other, other_call, size, said = sliding
        hidden = (~placed.seen) & placed.judged & (np.abs(placed.keys[None, :] - placed.own[:, None]) < size)[None, None]
        if not hidden.any():
            continue  # (every key the sliding layer sees, this one sees too)
        b, _, q, k = first_cell(hidden)
        found.append((call, Finding("full-narrower-than-sliding", (
            f"{_layer(index, call)} is a full layer ({kind[1]}) but causal, while {_layer(other, other_call)} of the "
            f"same model call, a sliding one ({said}), sees both ways (band({size})): query {int(placed.own[q])} "
            f"does not see key {k}, which the sliding layer sees; a full layer sees at least what a sliding one does "
            f"(a causal flag left on a bidirectional model's attention?)"),
            expected="full", source=f"{kind[1]} ({stated.sources.get('layer_types', said)})", cell=(b, int(placed.own[q]), k))))
    return found


def extended(run: Run) -> list:
    """A call site whose mask grows by one key per query, its earlier columns kept, where a query sees an appended
    key of a position its first step's mask hides from it."""
    found = []
    for calls in run.sites().values():
        if len(calls) < 2:
            continue
        base = previous = None  # (calls, not cells: a mask is made dense only where a step extends its first one)
        for call in calls:
            q_len, k_len = call.shape[2:]
            if q_len < 2 or k_len == q_len:
                base = previous = call if q_len > 1 else None
                continue
            if base is None or not repeated(run, previous, call):
                base = previous = None
                continue
            previous = call
            cells, first = keep(call), keep(base)
            if cells is None or first is None:
                continue
            block, first = np.broadcast_arrays(cells[..., -q_len:], first)
            real_q, real_k = first.any(axis=-1)[..., :, None], first.any(axis=-2)[..., None, :]
            leak = block & ~first & real_q & real_k  # (padding rows and keys of the first step left out)
            if not leak.any():
                continue
            b, _, q, k = first_cell(leak)
            step = call.step
            found.append((call, Finding("extension-leak", (
                f"{call.where} at step {step} keeps its earlier mask and appends {q_len} keys, one per query (the same "
                f"{q_len} positions again), but query {q} sees appended key {k_len - q_len + k} (position {k}), which "
                f"its own mask at the first step hides ({int(leak.any(axis=1).sum())} such cells; row {b}'s query {q} "
                f"sees positions {spans(np.flatnonzero(first[b, :, q].any(axis=0)).tolist())} there): the appended "
                f"block must follow the first mask (a draft key only where its position is seen: the diagonal)"),
                expected="the first step's mask on the appended keys", source=f"{call.where} at its first step",
                cell=(b, q, k_len - q_len + k))))
            break  # (one finding per site: the later steps repeat it)
    return found


def repeated(run: Run, earlier, call) -> bool:
    """`call` is `earlier`'s queries again with as many keys appended, its first columns `earlier`'s mask exactly, and
    the model call states no position of its queries (a draft's test-time steps, not a prompt's next chunk)."""
    top = run.top(call)
    if top is not None and any(name in top.arguments for name in POSITIONS) or call.details.get("queries") is not None:
        return False
    q_len = call.shape[2]
    if earlier.shape[2] != q_len or call.shape[3] != earlier.shape[3] + q_len:
        return False
    cells, before = keep(call), keep(earlier)
    return cells is not None and before is not None and same_cells(before, cells[..., :-q_len])


def same_cells(earlier: np.ndarray, columns: np.ndarray) -> bool:
    """The two cell arrays are the same once broadcast (batch rows or heads that repeat kept once in either); False
    where they do not broadcast."""
    try:
        left, right = np.broadcast_arrays(earlier, columns)
    except ValueError:
        return False
    return bool((left == right).all())


RULES = (
    Rule("causal-flag-ignored", "wrong", "call", "a module whose own attribute states it causal (self.causal, "
         "self.is_causal) whose softmax or kernel over square scores masks nothing", flag_ignored),
    Rule("full-narrower-than-sliding", "wrong", "steps", "a full-attention layer run causal where the sliding layers "
         "of the same model call see a symmetric window (an encoder's attention flagged causal)", full_narrower),
    Rule("extension-leak", "wrong", "site", "a mask extended by one key per query each step (a draft model's "
         "training-time test) whose appended keys are seen where the first step's mask hides their positions",
         extended),
)
