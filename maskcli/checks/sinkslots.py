"""A rolling KV cache with attention sinks whose kernel was handed a window of the cache buffer that leaves the sink
out.

A rolling cache with sinks (Self-Forcing, CausVid, LightX2V's lingbot, LongLive) keeps its `sink_size` sink frames
in the buffer's first sink_size x frame_seqlen slots: when it is full it evicts the oldest frames behind them and rolls
the rest forward, so the window it hands the kernel, `k[attn_start:local_end]`, always starts at slot 0 once the
buffer is sized to the window. Where the program states a sink (trace/sinkslots.py: an object of the program's frames
with `sink_size` and the tokens a frame) and the kernel's keys are a view of a buffer starting past slot 0, the sink's
slots are not among the keys any query sees: the buffer is bigger than the window it is sliced to (it rolls late or
never) and the slice takes the latest frames only (ModelTC/LightX2V#1008: the lingbot cache sized for the whole video with
local_attn_size set; the fix sizes it local_attn_size x frame_seq_length. Written another way: a buffer of the sink
plus local_attn_size frames sliced to the last local_attn_size).

Quiet where no frame states a sink (or states 0), where the keys are the buffer's first slots on, where they are
a new tensor (a sink joined to the window by torch.cat), and on cross-attention.
"""

from __future__ import annotations

from maskcli.checks.context import Run, cross
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def sink_left_out(run: Run) -> list:
    """Self-attention calls whose keys are a window of a cache buffer past the first slots a stated sink holds."""
    found, done = [], {}
    for call in run.calls:
        said = call.details.get("sink_slots")
        if not said or cross(call):
            continue
        start, end, length, sink, source = said
        if start < sink:
            continue  # (the sink's slots, or some of them, among the keys: another rule's, if any)
        if said not in done:
            done[said] = Finding("sink-left-out", (
                f"the kernel's keys are slots {start}-{end - 1} of a cache buffer of {length} slots, while {source} "
                f"keeps its sink in slots 0-{sink - 1}: no query sees the sink frames (a buffer larger than the window "
                f"it is sliced to: the slice takes the latest frames and drops the sink; size the cache "
                f"local_attn_size x frame_seqlen?)"),
                expected=f"the sink's slots 0-{sink - 1} among the keys", source=source)
        found.append((call, done[said]))
    return found


RULES = (
    Rule("sink-left-out", "wrong", "steps", "a rolling KV cache whose stated sink frames (sink_size x frame_seqlen "
         "slots at the buffer's front) are not among the keys the kernel was handed: a window sliced past them "
         "(LightX2V's lingbot cache sized for the whole video, never rolling)", sink_left_out),
)
