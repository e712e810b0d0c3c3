"""Blocks drafted in parallel whose block mask is not the one the same layer drafts a block alone with.

A block drafter (DFlash, block diffusion, a parallel-decoding head) is trained on many blocks at once and run one block
at a time: the same call site attends, in one call, Q = n·q queries whose own keys (the last Q key columns, the queries
placed at the end of their keys) fall apart into n blocks of q that see nothing of each other's keys, and, in other
calls, q queries alone over their context (the drafting steps). Those steps state how a block attends its own keys: the
q×q square of their last q columns, the same in every step and batch row. Each block of the parallel call must attend
its own keys the same way; a block that differs trains the drafter on another mask than it drafts with (SpecForge#427:
the training mask's block half was `same_block & (j >= i)`, each position seeing only itself and later ones, while
`spec_generate` drafts each block with no mask at all). Read over the heads, per batch row, on the queries that see
some own key and the keys some query sees (a padded query or key, hidden from all, is the padding's); left alone where
the steps disagree among themselves, where the parallel call's own square has a cell across blocks (a causal prefill, a
chunked one: not blocks) or falls apart inside one (packed segments of other sizes: images of 12, 4 and 8 patches
beside calls of 12), or where no call of q queries runs at the site. Nor where no key before the call's own is seen by two of its blocks:
blocks drafted from one sequence share its context, while requests packed in one row share none (transformers'
continuous batching packs each step's requests, each over its own cached keys, written blind, quiet-r68a).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _square(call, size: int) -> np.ndarray | None:
    """Bool (B, size, size): the call's cells over its last `size` key columns (its queries' own keys), over the heads;
    None where not kept."""
    cells = keep(call)
    return None if cells is None else cells.any(axis=1)[..., -size:]


def _step_square(calls: list, q: int) -> np.ndarray | None:
    """Bool (q, q): the square every call of q queries at the site shows over its own keys, in every batch row; None
    where they differ or none is kept."""
    found = None
    for call in calls:
        square = _square(call, q)
        if square is None:
            return None
        for row in square:
            if found is None:
                found = row
            elif not np.array_equal(found, row):
                return None
    return found


def blocks_differ(run: Run) -> list:
    """Parallel calls whose blocks attend their own keys otherwise than the site's calls of one block do."""
    found = []
    for calls in run.sites().values():
        sizes = {call.shape[2] for call in calls if not cross(call)}
        if len(sizes) < 2:
            continue  # one shape of queries at the site (most sites stop here)
        for q in sorted(size for size in sizes if size >= 2):
            steps = [call for call in calls if call.shape[2] == q and not cross(call)]
            wide = [call for call in calls if call.shape[2] > q and call.shape[2] % q == 0 and not cross(call)]
            if not wide:
                continue
            step = _step_square(steps, q)
            if step is None:
                continue
            for call in wide:
                finding = _judged(call, q, step)
                if finding is not None:
                    found.append((call, finding))
    return found


def _split(cells: np.ndarray, q: int) -> bool:
    """Whether the (Q, Q) own square falls apart somewhere inside a block of q: no cell across a boundary that is not a
    multiple of q (packed segments of other sizes, such as images of 12, 4 and 8 patches beside calls of 12), a
    boundary next to a token that sees and is seen by nothing (padding) left aside."""
    size = cells.shape[0]
    at = np.arange(size)
    right = np.where(cells.any(axis=1), size - 1 - np.argmax(cells[:, ::-1], axis=1), -1)  # each row's last key
    left = np.where(cells.any(axis=1), np.argmax(cells, axis=1), size)  # and its first
    bounds = at[1:]
    crossed = (np.maximum.accumulate(right)[:-1] >= bounds) | (np.minimum.accumulate(left[::-1])[::-1][1:] < bounds)
    empty = ~cells.any(axis=1) & ~cells.any(axis=0)
    inside = (bounds % q != 0) & ~empty[:-1] & ~empty[1:]
    return bool((~crossed & inside).any())


def _shared_context(call, size: int, q: int) -> bool:
    """Whether some key before the call's own (its context) is seen by queries of two of its blocks in a batch row:
    blocks drafted from one sequence share its context; requests packed in one row (a continuous-batching step, each
    over its own cache) share none."""
    cells = keep(call)
    offset = call.shape[3] - size
    if cells is None or offset <= 0:
        return False
    context = cells.any(axis=1)[..., :offset]  # (B, Q, context keys)
    by_block = context.reshape(context.shape[0], size // q, q, offset).any(axis=2)
    return bool((by_block.sum(axis=1) >= 2).any())


def _judged(call, q: int, step: np.ndarray) -> Finding | None:
    """The finding for a parallel call of n blocks of q against the step's square, None where it agrees or is no
    blocks."""
    size = call.shape[2]
    own = _square(call, size)
    if own is None:
        return None
    block = np.arange(size) // q
    same = block[:, None] == block[None, :]
    if (own & ~same).any() or _split(own.any(axis=0), q):
        return None  # a query sees another block's own keys (a prefill), or the call's own segments are not blocks of q
    if not _shared_context(call, size, q):
        return None  # (no key seen by two blocks: sequences of their own packed in one row, an engine's requests)
    tiled = np.broadcast_to(np.tile(step, (size // q, size // q)) & same, own.shape)
    real = own.any(axis=2)[:, :, None] & own.any(axis=1)[:, None, :]  # queries and keys some cell of the row keeps
    differ = (own != tiled) & real  # (a padded query or key, hidden from all: the padding's, not the block's)
    if not differ.any():
        return None
    b, i, j = first_cell(differ)
    offset = call.shape[3] - size
    return Finding("blocks-differ-from-steps", (
        f"{size // q} blocks of {q} queries attended at once: query {i} of batch row {b} (position {i % q} of block "
        f"{i // q}) {'sees' if own[b, i, j] else 'misses'} its block's key {j % q}, which the site's calls of one "
        f"block of {q} queries {'hide' if own[b, i, j] else 'show'} ({int(differ.sum())} such cells): a block drafted "
        f"alone attends its own keys otherwise"),
        expected="each block's own keys as the site's one-block calls attend them",
        source=f"the calls of {q} queries at {call.where}", cell=(b, i, offset + j))


RULES = (
    Rule("blocks-differ-from-steps", "wrong", "steps", "blocks drafted in parallel (n blocks of q queries that see "
         "nothing of each other's own keys) whose block attends its own keys otherwise than the same site's calls of "
         "one block of q queries do", blocks_differ),
)
