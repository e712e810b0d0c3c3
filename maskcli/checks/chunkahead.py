"""A streaming encoder's chunk whose right context grows with depth past the one the model states.

A latency-controlled encoder (neural_sp's `streaming_type='mask'`) splits its frames into chunks of N_c, each chunk
seeing N_l frames before it and N_r after it: the model's own `chunk_size_current` and `chunk_size_right` (trace/stated.py
reads a module's int chunk size and right context). N_r is the encoder's look-ahead, its latency: a chunk's outputs
may depend on frames up to N_r after the chunk's end. A layer's mask that lets a chunk see N_r frames after it is
right at the first layer; where every layer does, the frames of that right context saw N_r frames after their own
chunk at the layer before, and the look-ahead grows with depth (neural_sp#121: the upper layers cut at the chunk end).

Read per model call and batch row: the layers' masks over the same frames (self-attention, queries and keys alike, in
the order the layers ran) composed (a frame's output at the last layer depends on the input frames its queries reach
through every layer); said where a real frame's output reaches a real frame more than N_r after its chunk's end, and
only where the first layer's mask keeps within the stated N_r and reaches it (the chunks and right context are the ones
it states).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep, layer
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _bound(t: int, size: int, right: int) -> np.ndarray:
    """Each query's last allowed key: the end of its chunk plus the right context."""
    at = np.arange(t)
    return (at // size + 1) * size - 1 + right


def compounds(run: Run) -> list:
    """Model calls whose stack of chunk masks lets a chunk depend on frames past its stated right context."""
    found = []
    for top in run.tops:
        said = next((one for one in top.stated if "chunk_right" in one.fields), None)
        if said is None:
            continue
        (size, right), scope = said.fields["chunk_right"], said.fields.get("chunk_scope") or ""
        calls = [call for call in run.made_by(top) if not cross(call) and call.shape[2] == call.shape[3] > size
                 and (call.where or "").startswith(scope)]
        layers = [layer(call) for call in calls]
        if len(calls) < 2 or None in layers or len(set(layers)) != len(layers) or layers != sorted(layers) \
                or len({call.shape[3] for call in calls}) != 1:
            continue
        masks = [keep(call) for call in calls]
        if any(m is None for m in masks):
            continue
        rows = max(m.shape[0] for m in masks)
        cells = [np.broadcast_to(m.any(axis=1), (rows, *m.shape[2:])) for m in masks]
        t = cells[0].shape[-1]
        bound = _bound(t, size, right)
        real = cells[0].any(axis=1)  # (rows, T): the keys the first layer lets any query see
        first = cells[0] & real[:, :, None]
        over = np.arange(t)[None, :] > bound[:, None]
        if (first & over[None]).any() or not (first & (np.arange(t)[None, :] == bound[:, None])[None]).any():
            continue  # (the first layer keeps past it, or never reaches it: not the chunks it states)
        reach = cells[0].astype(np.int64)
        for each in cells[1:]:
            reach = np.minimum(each.astype(np.int64) @ reach, 1)
        bad = reach.astype(bool) & real[:, :, None] & real[:, None, :] & over[None]
        if not bad.any():
            continue
        b, q, k = (int(x[0]) for x in np.nonzero(bad))
        found.append((calls[-1], Finding("chunk-lookahead-compounds", (
            f"batch row {b}: frame {q}'s output after the {len(calls)} layers depends on frame {k}, "
            f"{k - (int(bound[q]) - right)} frames after the end of its chunk (frames {q // size * size}-"
            f"{q // size * size + size - 1}), while the encoder states a chunk of {size} with {right} frame{'s' if right != 1 else ''} "
            f"of right context ({said.source}): every layer lets a chunk see its right context, so the look-ahead grows with "
            f"depth (the upper layers cut at the chunk's end?)"),
            expected=f"frames up to {int(bound[q])} for frame {q}", source=said.source, cell=(b, q, k))))
    return found


RULES = (
    Rule("chunk-lookahead-compounds", "wrong", "steps", "a streaming encoder's chunk whose outputs, through the "
         "layers' masks composed, depend on frames past the chunk's right context the model states "
         "(chunk_size_right: every layer given the right context, neural_sp#121)", compounds),
)
