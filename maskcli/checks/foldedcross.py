"""A cross-attention that folds its batch into one sequence, whose samples see each other's memories.

Diffusion transformers' cross-attention (PixArt's `MultiHeadCrossAttention`, ComfyUI's ports, Sana's) flattens the
batch: the image queries (B, N) become one sequence of B * N, the captions one sequence of their real tokens laid end
to end, and a block-diagonal mask (xformers' `BlockDiagonalMask.from_seqlens([N] * B, y_lens)`, or `torch.block_diag`
in its torch fallback) keeps each sample's queries on its own caption. What the program states: the layer's forward
was handed (B, N) queries (trace/queried.py), the kernel attends one row of B * N queries, and the program holds B
lengths (trace/held.py: `y_lens`, the caption lengths) that sum to the call's keys, or, holding none, was handed the
memories as a (B, M, D) tensor beside its (B, N, D) queries and folded them into the call's B * M keys
(trace/queried.py's memory_input: Open-Sora#609, `mask=None` for unpadded prompts, so no block diagonal was built). A query of sample b that sees a key
of another sample's span is wrong (ComfyUI_ExtraModels#36: the SDP fallback's float mask of zeros lets every image
attend every caption, its cond and uncond halves mixed). Quiet where each sample's queries see only their own span
(the fix's block diagonal), where the lengths do not sum to the keys or are not one per sample (the memory is shared
or not split by them), where the kernel keeps the batch (B rows: nothing folded), and on self-attention.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _spans(call, batch: int) -> tuple[np.ndarray, dict] | None:
    """(cumulative key ends, the held reading) of the first lengths held at the call, one per sample, that sum to the
    call's keys; None where none."""
    k_len = int(call.shape[3])
    for held in call.details.get("held_padding") or ():
        rows = held.get("rows")
        if held.get("kind") != "lengths" or not isinstance(rows, np.ndarray) or rows.ndim != 1 or len(rows) != batch:
            continue
        lengths = rows.astype(np.int64)
        if lengths.min() >= 1 and int(lengths.sum()) == k_len:
            return np.concatenate([[0], np.cumsum(lengths)]), held
    return None


def _memories(call, batch: int) -> tuple[np.ndarray, dict] | None:
    """(cumulative key ends, a reading) of the memories the layer's forward was handed as a (B, M, D) tensor beside its
    (B, N, D) queries, folded into the call's B * M keys (trace/queried.py's memory_input): B spans of M keys each."""
    memory = call.details.get("memory_input")
    if not memory or int(memory[1]) != batch or batch * int(memory[2]) != int(call.shape[3]):
        return None
    return np.arange(batch + 1) * int(memory[2]), {
        "name": memory[0], "where": f"the layer's forward argument, ({batch}, {int(memory[2])}, ...)"}


def samples_see_other_memories(run: Run) -> list:
    """Per call site, its first cross-attention call over a folded batch whose sample sees another sample's keys."""
    found, seen = [], set()
    for call in sorted((*run.calls, *run.cross, *run.unmasked), key=lambda c: c.index):
        given = call.details.get("query_input")
        if not given or call.where in seen or int(call.shape[0]) != 1 or not cross(call):
            continue
        batch, n = int(given[0]), int(given[1])
        if batch < 2 or int(call.shape[2]) != batch * n:
            continue
        spans = _spans(call, batch) or _memories(call, batch)
        if spans is None:
            continue
        ends, held = spans
        if any(call is one for one in run.unmasked):
            cells = np.ones((int(call.shape[2]), int(call.shape[3])), dtype=bool)
        else:
            stored = keep(call)
            if stored is None:
                continue
            cells = stored.any(axis=(0, 1))  # (a cell any head sees)
        sample = np.repeat(np.arange(batch), n)  # the sample of each query
        own = np.zeros_like(cells)
        for b in range(batch):
            own[sample == b, ends[b]:ends[b + 1]] = True
        leak = cells & ~own
        if not leak.any():
            continue
        q, k = (int(x) for x in np.argwhere(leak)[0])
        other = int(np.searchsorted(ends[1:], k, side="right"))
        seen.add(call.where)
        found.append((call, Finding("samples-see-other-memories", (
            f"the cross-attention at {call.where} was handed {batch} samples of {n} queries and attends them as one "
            f"sequence of {batch * n} over {int(call.shape[3])} keys, the {batch} memories of `{held['name']}` "
            f"({held['where']}: {[int(x) for x in np.diff(ends)]}) laid end to end; query {q} (sample {q // n}) sees "
            f"key {k}, of sample {other}'s memory: the samples of the batch see each other's memories"),
            expected="each sample's queries on its own memory (a block diagonal)",
            source=f"{held['name']} ({held['where']}) and the layer's (B, N) queries", cell=(0, q, k))))
    return found


RULES = (
    Rule("samples-see-other-memories", "wrong", "call", "a cross-attention that folds its batch into one sequence "
         "(B * N queries over the memories laid end to end) whose samples see each other's memories",
         samples_see_other_memories),
)
