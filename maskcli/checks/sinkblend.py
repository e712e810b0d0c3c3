"""A running attention sink blended with keys its window still holds: the frames merged are not the evicted ones.

A video model states its rolling cache in frames (trace/framebudget.py: `sink_size` sink frames of `frame_seqlen`
tokens among `local_attn_size`): the first sink x frame_seqlen keys a call reads are the sink, the rest the latest
frames. A sink kept as a running summary (an EMA: `sink = alpha * sink + (1 - alpha) * evicted`) absorbs the frames
that leave the window, which no call reads directly any more. trace/sinkblend.py records where the rows a call reads
changed since its site's last call by such a blend with a key the same call reads elsewhere. Where the blended rows lie
in the stated sink and the keys blended in lie past it, the sink absorbed frames the window still holds: they count
twice and the frames that left are lost (JaydenLyh/Reward-Forcing#5: the evicted slice taken from `sink + rolled`, the
newest frames, instead of from `sink`, the oldest that leave). Said once per site. Quiet where the keys blended in are
no key of the call (the evicted frames, as the fix takes), where no sink is stated, and where a blended row lies past
the sink (a window row, not the summary).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _sink(top) -> tuple | None:
    """(sink keys, frames, tokens a frame) the model call's frame budget states, None where it states no sink."""
    said = next((one.fields["frame_budget"] for one in top.stated if "frame_budget" in one.fields), None) \
        if top is not None else None
    if said is None or not said[2]:
        return None
    return said[2] * said[1], said[2], said[1]


def sink_blends_kept(run: Run) -> list:
    """(call, Finding) for the first call of each site whose stated sink rows blend keys past the sink."""
    found, done = [], set()
    for call in run.calls:
        held = call.details.get("sink_blend")
        if not isinstance(held, dict) or call.where in done:
            continue
        sink = _sink(run.top(call))
        if sink is None:
            continue
        size, frames, per_frame = sink
        rows, partners = held["rows"], held["from"]
        if max(rows) >= size or min(partners) < size:
            continue
        done.add(call.where)
        lo, hi = min(partners), max(partners)
        found.append((call, Finding("sink-blends-kept-keys", (
            f"{call.where}: the model states {frames} sink frames of {per_frame} tokens (the first {size} keys a call "
            f"reads), and {len(rows)} of them changed since the site's last call by a blend (1 - w) x sink + w x key, "
            f"w = {held['w']:g}, with keys {lo} .. {hi} of this same call (step {call.step}): frames the window still "
            f"holds, read directly beside the sink, so they count twice while the frames that left the window are "
            f"merged nowhere (merge the evicted oldest frames)"),
            expected="the sink blended with the frames evicted from the window", source="the model's frame budget",
            cell=(0, 0, rows[0]))))
    return found


RULES = (
    Rule("sink-blends-kept-keys", "wrong", "steps", "a running attention sink (the stated sink frames of a rolling "
         "cache) blended with keys the same call still reads in its window: it merged the newest frames, not the "
         "evicted ones (Reward-Forcing#5)", sink_blends_kept),
)
