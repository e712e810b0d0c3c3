"""A video model's queries that see more frames than the rolling KV cache the program states keeps.

Autoregressive video diffusion (CausVid, Self-Forcing, FastVideo's causal Wan, LongLive) keeps a rolling KV cache of
`local_attn_size` frames, its `sink_size` sink frames among them, each frame `frame_seqlen` tokens (read where the
program states both, trace/framebudget.py). No query may then see more than local_attn_size x frame_seqlen keys,
whatever builds its mask: the training forward's block-causal mask over the whole clip must keep what inference's
cache keeps, or the model trains on history it never has (FastVideo dad62979e: the fused block-causal + sink kernel
given `rolling_window_tokens = local_attn_size * frame_seqlen`, the sink frames counted twice, so each query block
past the second saw one frame more than the cache holds), and a decode step handed more cached frames than that
(sink frames plus local_attn_size more) reads a cache the model says it evicted.

Counted per batch row, head and query, in keys the mask keeps (padding hidden by the mask only lowers the count);
quiet on cross-attention (the keys are a text's), where local_attn_size is -1 (every frame kept) and where the
program's objects state different budgets.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

FLAG = "frame_budget"


def over_budget(run: Run) -> list:
    """Self-attention calls of a model whose stated rolling cache keeps local_attn_size frames, a query of which sees
    more keys than local_attn_size x frame_seqlen."""
    found = []
    for top in run.tops:
        said = next((one for one in top.stated if FLAG in one.fields), None)
        if said is None:
            continue
        local, per_frame, sink = said.fields[FLAG]
        if local is None:
            continue  # (frames stated, no cache size: every frame kept)
        budget, done = local * per_frame, {}
        unmasked = [call for call in run.unmasked if top.first <= call.index < top.end]  # (a softmax masking nowhere)
        for call in [*run.made_by(top), *unmasked]:
            if call.shape[3] <= budget or cross(call):
                continue
            key = (call.mask, call.shape)
            if key not in done:
                done[key] = _finding(call, budget, local, per_frame, sink, said.source)
            if done[key] is not None:
                found.append((call, done[key]))
    return found


def _finding(call, budget: int, local: int, per_frame: int, sink, source: str) -> Finding | None:
    cells = keep(call)
    if cells is None:
        return None
    seen = cells.sum(axis=-1)  # (b, h, Lq)
    if seen.max() <= budget:
        return None
    b, h, q = (int(x) for x in np.unravel_index(int(np.argmax(seen)), seen.shape))
    keys = np.flatnonzero(cells[b, h, q])
    count = int(seen[b, h, q])
    old = keys[keys >= (sink or 0) * per_frame]
    k = int(old[0] if len(old) else keys[0])
    sinks = f", its {sink} sink frame{'s' * (sink != 1)} among them" if sink is not None else ""
    return Finding("frames-over-cache", (
        f"batch row {b}: query {q} sees {count} keys ({count / per_frame:g} frames of {per_frame} tokens), while "
        f"{source} keeps {local} frames ({budget} keys) in the rolling KV cache{sinks}: the window counts frames the "
        f"cache evicts ({_why(count - budget, (sink or 0) * per_frame)})"),
        expected=f"at most {budget} keys ({local} frames) per query", source=source, cell=(b, q, k))


def _why(over: int, sink_keys: int) -> str:
    """The likelier cause of `over` keys past the budget: the sink counted twice, else a cache that never rolls."""
    if 0 < over <= sink_keys:
        return "the sink frames counted again on top of local_attn_size?"
    return "a cache that never rolls: local_attn_size read as -1 or the cache sized for the whole video?"


RULES = (
    Rule("frames-over-cache", "wrong", "steps", "a video model's query sees more keys than the rolling KV cache of "
         "`local_attn_size` frames (sink frames among them) x `frame_seqlen` tokens the program states (FastVideo's "
         "block-causal sink window given local_attn_size frames past the sink)", over_budget),
)
