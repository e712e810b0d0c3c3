"""A streaming encoder's chunk mask whose left context is not the one its chunk config states.

Dynamic chunk training masks each frame to its own chunk, whole, and a left context of chunks before it: SpeechBrain's
`DynChunkTrainConfig(chunk_size, left_context_size)` (left_context_size counts *chunks*, None: the whole past), WeNet's
`num_left_chunks`, icefall's `left_context_frames` (frames, kept as whole chunks: left_context_frames // chunk_size).
The config the functions on the stack hold at the call (trace/heldchunks.py: it is handed to the encoder's forward
and the mask builder, which has returned) says, for a frame of chunk c, the keys from chunk c - left's first frame to
chunk c's last. Read per batch row, with its padding resolved first (the real frames are the keys some query of the
row sees, a run from 0: right-padded), on its real queries, and only where the mask is that chunk mask on its right
edge (every real query sees up to its chunk's last real frame and nothing past it: the chunks the config states).
A real query that sees from another first key contradicts the config (speechbrain#2140: left_context_size subtracted
as frames, so each chunk kept 2 frames of the past, not 2 chunks). Left alone: cross-attention, calls no longer than
one chunk, a mask with holes inside a row (not a chunk mask), a row whose seen keys do not run from 0.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _start(chunk_of: np.ndarray, held: dict) -> np.ndarray:
    """Each query's first key the config lets it see."""
    size, left = held["chunk"], held["left"]
    if left is None:
        return np.zeros_like(chunk_of)
    chunks = left if held["unit"] == "chunks" else left // size
    return np.maximum(chunk_of - chunks, 0) * size


def left_context(run: Run) -> list:
    """Calls whose real queries see from another first key than the chunk config the program holds states."""
    found, done = [], set()
    for call in run.calls:
        held = call.details.get("held_chunks")
        if held is None or call.stored is None or cross(call) or call.shape[2] != call.shape[3] \
                or call.shape[3] <= held["chunk"]:
            continue
        key = (call.mask, call.shape, held["chunk"], held["left"], held["unit"])
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        if cells is None:
            continue
        finding = _judged(cells.any(axis=1), held)
        if finding is not None:
            found.append((call, finding))
    return found


def _judged(cells: np.ndarray, held: dict) -> Finding | None:
    """The finding for (B, T, T) cells against the held chunk config, None where it keeps to it or is no chunk mask."""
    size, t = held["chunk"], cells.shape[-1]
    at = np.arange(t)
    chunk_of = at // size
    start = _start(chunk_of, held)
    for b in range(cells.shape[0]):
        row = cells[b]
        seen = np.flatnonzero(row.any(axis=0))
        if seen.size == 0 or seen[0] != 0 or seen[-1] != seen.size - 1:
            continue  # (no run of real frames from 0: not a right-padded row this reads)
        n = int(seen.size)
        real = row[:n, :n]
        if not real.any(axis=1).all() or row[:n, n:].any():
            continue
        first = real.argmax(axis=1)
        last = n - 1 - real[:, ::-1].argmax(axis=1)
        ends = np.minimum((chunk_of[:n] + 1) * size, n) - 1
        runs = real.sum(axis=1) == last - first + 1
        if not runs.all() or not (last == ends).all():
            return None  # (holes in a row, or right edges not the stated chunks': not this config's chunk mask)
        wanted = np.minimum(start[:n], ends)
        bad = np.flatnonzero(first != wanted)
        if bad.size == 0:
            continue
        q = int(bad[0])
        c = int(chunk_of[q])
        left = held["left"]
        stated = "the whole past" if left is None else f"{left} {held['unit']} of left context"
        fewer = first[q] > wanted[q]
        return Finding("chunk-left-context", (
            f"batch row {b}: frame {q} (chunk {c}, frames {c * size}-{min((c + 1) * size, n) - 1}) sees frames "
            f"{int(first[q])}-{int(last[q])}, but the chunk config the program holds states chunks of {size} with "
            f"{stated} ({held['said']}): frames {int(wanted[q])}-{int(last[q])}; "
            + (f"{_frames(int(wanted[q]), int(first[q]) - 1)} hidden" if fewer else
               f"{_frames(int(first[q]), int(wanted[q]) - 1)} seen too")
            + f" ({int(bad.size)} such frames in this row)"
            + (" — the left context counted in frames, not chunks?" if fewer and held["unit"] == "chunks"
               and left is not None and first[q] == max(c * size - left, 0) else "")),
            expected=f"frames {int(wanted[q])}-{int(last[q])} for frame {q}", source=held["said"],
            cell=(b, q, int(wanted[q]) if fewer else int(first[q])))
    return None


def _frames(a: int, b: int) -> str:
    return f"frame {a} is" if a == b else f"frames {a}-{b} are"


RULES = (
    Rule("chunk-left-context", "wrong", "call", "a streaming encoder's chunk mask whose left context is not the one "
         "the chunk config the program holds states (left_context_size chunks read as frames: speechbrain#2140)",
         left_context),
)
