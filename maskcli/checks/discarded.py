"""A masked_fill the program made of its scores and threw away: the keys it fills are attended all the same.

`scores.masked_fill(mask, -1e9)` is out of place. Written as a statement, its result never bound, it changes nothing:
the softmax reads the scores as they were (mead-baseline#223: Bahdanau attention's `a.masked_fill(keys_mask == 0,
-1e9)`, so the RNN decoder attends the padded source states; ParlAI#3068: the poly-encoder's codes attention
`l1.masked_fill(attn_mask, neginf)`, so the codes attend the context's padding). The fill is the program's own word on
which keys it hides; trace records it where its result was freed before the softmax ran over the unchanged scores
(details `fill_discarded`, trace/discarded.py); likewise an attention mask so filled and handed to SDPA unfilled
(Qwen#933: `attention_mask.masked_fill(~causal_mask, min)` as a statement, the padding bias alone reaching the kernel). A query that sees a key that fill hides, while it sees some key the
fill leaves, is *wrong*. Quiet: the fill assigned (`a = a.masked_fill(...)`) or made in place (`masked_fill_`), its
result still held when the softmax runs (the program may use it otherwise), a fill that hides nothing, and a row the
fill would hide whole (a softmax over -1e9 everywhere is as uniform as over nothing: no key of it is favoured).
A fill bound to a name that no call reads before it dies (arghosh/AKT 01b7e8d: `scores_ = scores.masked_fill(...)`,
then `scores_ = F.softmax(scores)`, the unfilled scores) is thrown away as much (trace/discarded.py's `bound`).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _hidden(call) -> np.ndarray | None:
    """Bool (b, h, Lq, Lk) the discarded fill of `call`'s scores would hide, as the call's cells; None where none."""
    said = call.details.get("fill_discarded")
    hidden = said.get("hidden") if isinstance(said, dict) else None
    if not isinstance(hidden, np.ndarray) or hidden.ndim != 4 or tuple(hidden.shape) != tuple(call.shape):
        return None
    return hidden


def discarded(run: Run) -> list:
    """Calls whose queries see keys that a masked_fill of their scores, its result thrown away, was to hide."""
    found, done = [], {}
    for call in [*run.calls, *run.cross, *run.unmasked]:
        hidden = _hidden(call)
        if hidden is None or not hidden.any() or call.stored is None:
            continue
        key = (call.mask, tuple(call.shape), hidden.tobytes())
        if key not in done:
            done[key] = None
            cells = keep(call)
            if cells is None or cells.shape[0] not in (1, hidden.shape[0]) or cells.shape[1] not in (1, hidden.shape[1]):
                continue
            cells = np.broadcast_to(cells, hidden.shape)
            left = (cells & ~hidden).any(axis=-1, keepdims=True)  # (a row the fill hides whole: no statement of it)
            bad = cells & hidden & left
            if bad.any():
                b, _, q, k = (int(x) for x in np.argwhere(bad)[0])
                value = call.details["fill_discarded"].get("value")
                what, reads, read = ("these scores", "softmax", "the scores") if call.api == "softmax" else (
                    "this attention mask", "kernel", "the mask")
                how = ("that fill's result, bound to a name, is never read: the {reads} reads {read} it was made of, "
                       "unfilled ({n} such cells; softmax the filled tensor)") if call.details["fill_discarded"].get(
                    "bound") else ("that fill's result was thrown away: masked_fill is out of place and the {reads} "
                                   "reads {read} unfilled ({n} such cells; assign it, or use masked_fill_)")
                done[key] = Finding("fill-discarded", (
                    f"batch row {b}: query {q} sees key {k}, which the program's masked_fill of {what} (value "
                    f"{value:g}) hides, but " + how.format(reads=reads, read=read, n=int(bad.any(axis=1).sum()))),
                    expected="the keys the masked_fill hides unseen",
                    source=f"the masked_fill of {what}", cell=(b, q, k))
        if done[key] is not None:
            found.append((call, done[key]))
    return found


RULES = (
    Rule("fill-discarded", "wrong", "call", "a masked_fill of the scores whose result is thrown away (out of place, "
         "never bound): the softmax attends the keys the fill was to hide", discarded),
)
