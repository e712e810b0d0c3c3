"""A decode step behind its cache whose model call was handed more new tokens than the cache took in.

A model call handed the whole sequence so far (fairseq's incremental decoder, `decoder(tokens[:, :i],
incremental_state=...)`, which embeds the last token alone and keeps the others' keys in its cache) states how many
tokens the sequence holds. Two calls of one self-attention site made by successive model calls, the later's token ids
extending the earlier's (the earlier's are the first ones of the later's, row for row), the later's keys the earlier's
plus its own queries (a cache that appends), say how many tokens came into the sequence (the ids' growth) and how many
keys came into the cache (the step's queries). Where more tokens came than keys, the tokens in between were never run
through the layer: no later query sees them (facebookresearch/esm PR #438: ESM-IF1's sample() `continue`d past the
positions partial_seq fixed, so the token before each never entered the incremental state). Wrong: the program's own
ids and its own cache disagree on the sequence.

Quiet where the ids do not extend the earlier call's (transformers' generate hands each step its new tokens alone;
a prefix cut to a block, or rows reordered by a beam, shift them), where the keys are not the earlier's plus the
step's own (a windowed or static cache, a pass that re-reads the whole prefix), and where the ids grow by the step's
queries (every token run through the decoder: the fix).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.checks.tokens import _ids
from maskcli.text import Finding


def _extends(before, after) -> bool:
    """`after` (B, L') holds `before` (B, L), L < L', as its first ids in every row."""
    return isinstance(before, np.ndarray) and isinstance(after, np.ndarray) and before.ndim == after.ndim == 2 \
        and before.shape[0] == after.shape[0] and before.shape[1] < after.shape[1] \
        and bool((after[:, :before.shape[1]] == before).all())


def skipped(run: Run) -> list:
    """(call, Finding) for the first step of each site whose model call's ids grew by more tokens than its cache."""
    found = []
    for where, calls in run.sites().items():
        before = None
        for call in sorted(calls, key=lambda c: c.index):
            top = run.top(call)
            ids = None if top is None else _ids(top.arguments)
            step = (call, top, ids)
            if before is not None and before[1] is top:
                continue  # (the same model call again: a layer run twice, no step between)
            last, last_top, last_ids = before or (None, None, None)
            before = step
            if top is None or last_top is None or last_top.where != top.where:
                continue
            q_len, k_len = call.shape[2:]
            if k_len != last.shape[3] + q_len or call.shape[0] != last.shape[0] or not _extends(last_ids, ids):
                continue
            grown = ids.shape[1] - last_ids.shape[1]
            if grown <= q_len:
                continue
            lost = list(range(last_ids.shape[1], ids.shape[1] - q_len))
            shown = ", ".join(str(p) for p in lost[:8]) + (", ..." if len(lost) > 8 else "")
            said = f"the token ids {top.where} was handed"
            found.append((call, Finding("cache-tokens-skipped", (
                f"{top.where} was handed {ids.shape[1]} tokens, {grown} more than at its call before, but this site's "
                f"cache grew by {q_len} key(s) ({last.shape[3]} -> {k_len}): the token(s) at {shown} were never run "
                f"through the layer, and no later query sees them (a step skipped over tokens it was given?)"),
                expected=f"{ids.shape[1] - last_ids.shape[1] + last.shape[3]} keys, one for each token handed",
                source=said, cell=(0, q_len - 1, k_len - 1))))
            break
    return found


RULES = (
    Rule("cache-tokens-skipped", "wrong", "steps", "a decode step whose model call was handed more new tokens than its "
         "cache took in: tokens skipped over never enter the keys", skipped),
)
