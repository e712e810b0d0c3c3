"""How a decode step's cells stand against its prefill's (checks/steps.py's padding-lost and window-lost): a window moved
as one run or keys picked one by one, each query's own key seen where the step is placed, a prefill's padding held
at columns shifted past the step's own block, and whether any query reaches `window` keys back; and (top-left-mask's)
whether the site's next step fills on the same fixed buffer."""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import keep, runs


def windowed(later: np.ndarray, own: np.ndarray, padded, written, window: int) -> np.ndarray:
    """(B, H, Lq): each query sees every key of its window (the `window` keys up to its own), or every key from its first
    to its last one, or none (keys its prefill padded and no step `written` since aside): a window lost shows as the
    window and more, moved as one run. A step whose queries do neither was handed keys picked one by one (DeepSeek
    V3.2's top-k indexer: a prefill whose picks happened to be the last W keys reads as window(W)): no window lost."""
    columns = np.arange(k_len := later.shape[-1])
    upto = later & (before := columns[None, :] <= own[:, None])  # (Lq, Lk): the keys up to each query's own
    run = (columns >= upto.argmax(axis=-1)[..., None]) & (columns <= k_len - 1 - upto[..., ::-1].argmax(axis=-1)[..., None])
    near = before & (columns[None, :] > own[:, None] - window)
    if padded is not None and padded.shape[0] in (1, later.shape[0]):
        cut = np.zeros((padded.shape[0], k_len), dtype=bool)
        cut[:, :min(k_len, padded.shape[1])] = padded[:, :k_len]
        cut[:, [k for k in written if 0 <= k < k_len]] = False
        run, near = run & ~cut[:, None, None, :], near & ~cut[:, None, None, :]  # (a padded key may be seen or not)
    return ~upto.any(axis=-1) | ~(run & ~upto).any(axis=-1) | ~(near & ~later).any(axis=-1)


def placed_past_written(later: np.ndarray, own: np.ndarray, real: np.ndarray, written: int, since: set) -> bool:
    """The step was placed by guess in a static cache's unwritten tail: some real query (`real`: (B, 1, Lq)) does not see
    its own key where placed, and every key after the last one any query sees, its own slots aside, is one nothing
    wrote yet (past the prefill's `written` slots, none of the steps `since` it): gemma's `end_index % cache_size`
    buffer read through a softmax of the program's own (no K and V to find the unwritten slots by, trace/zerokv.py). A
    window ends at the query's own key: such a step's queries sit at the last key each sees (steps.py). Not where the
    keys a query misses after those it sees were written (Megatron-Bridge#5259: key 0 alone seen, keys 1.. written)."""
    k_len = later.shape[-1]
    if ((own >= 0) & (own < k_len)).all() and (later[..., np.arange(len(own)), own] | ~real).all():
        return False
    seen = np.flatnonzero(later.any(axis=tuple(range(later.ndim - 1))))
    tail = set(range(int(seen[-1]) + 1 if len(seen) else 0, k_len)) - set(own.tolist())
    return all(k >= written and k not in since for k in tail)


def held_after_own(later: np.ndarray, padded: np.ndarray, asking) -> bool:
    """The step's keys are its own Lq then the cache's (torch.cat([new, cached]): pi0/pi05's action expert over a
    cached prefix), and there every real query of the step hides every key its prefill padded, and sees some key of
    its own block: the padding is held, at columns Lq on, not lost. A step that lost its padding sees the padded
    keys under either reading (nothing hidden), so it is still found."""
    q_len, width = later.shape[-2], padded.shape[1]
    if later.shape[-1] < q_len + width:
        return False
    real = asking()[..., None]  # (B, 1, Lq, 1)
    shifted = later[..., q_len:q_len + width] & padded[:, None, None, :] & real
    if shifted.any():
        return False
    own = later[..., :q_len].any(axis=-1)  # (B, H, Lq): a real query sees some key of the step's own
    return bool(np.broadcast_to(own | ~real[..., 0], own.shape).all())


def reaches_back(call, later: np.ndarray, own: np.ndarray, window: int) -> bool:
    """Some query of the step sees a key `window` or more back: read off the stored runs' starts where it keeps one run
    a row (no pass over the cells), else off the cells."""
    found = runs(call.stored, later.shape[-1])
    if found is None:
        return bool((later & (np.arange(later.shape[-1]) <= own[:, None] - window)).any())
    starts, ends = found
    return bool(((starts < ends) & (starts <= own - window)).any())


def filling(run, call, cells: np.ndarray) -> bool:
    """The site's next call of the same shape is the next step over the same fixed buffer: its first query sees every
    key this call's last query sees and one more (its own slot, written since), so these queries sit at the last keys
    they see, not at the buffer's end (a top-left causal mask keeps seeing the first keys, step after step)."""
    calls = run.sites().get(call.where) or []
    after = next((other for other in calls if other.index > call.index and other.shape == call.shape), None)
    later = None if after is None else keep(after)
    if later is None or later.shape != cells.shape:
        return False
    seen, then = cells.any(axis=1)[:, -1], later.any(axis=1)[:, 0]  # (rows, Lk): the last query now, the first next
    return bool(seen.any()) and bool((then[seen]).all() if seen.shape == then.shape else False) \
        and bool((then.sum(axis=-1) == seen.sum(axis=-1) + 1).all())
