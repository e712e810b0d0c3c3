"""A trajectory model whose real tokens attend the zero-padded steps its own batch marks as padding.

Offline RL trainers slice fixed-length windows of episodes, pad the short ones with zeros and keep a 0/1 step mask
(d3rlpy's `batch.masks`, `traj_mask`, `timestep_mask`; True = padding for `*pad_mask`, `is_pad`). The program states
that padding twice: in the step mask a function that made the model call holds (a variable, or an entry of a dict:
`batch["masks"]`) and in the model call's float input (B, T, C), exactly zero on those steps and not all zero on
the real ones (trace/steppad.py). A Decision Transformer embeds each step as k tokens (return, state, action: k = 3),
interleaved (key i is step i // k) or laid out modality after modality (key i is step i % T), so a self-attention of
the call over its B rows has k x T keys (k x T - 1 at inference, the last action dropped: interleaved only). Where,
under every layout that fits, a token of a real step sees a token of a padded step, the step mask never reached the
attention: wrong (d3rlpy 9251cdeb: ContinuousDecisionTransformer applied only its causal tril, so the real
(return, state, action) tokens of front-padded short trajectories attended the zero-padded timesteps).

Quiet where the mask hides the padded steps from real tokens (the fix: `1 - batch.masks` interleaved 3x per step and
added as a key bias), on padded tokens' own rows, where the held mask's zeros are not the input's zero steps (a
burn-in or loss mask over real data), right-padded steps under a causal mask (never seen), cross-attention, calls of
another key count or another batch.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

TOKENS = 4  # tokens a step at most (return, state, action, and one more: a reward or a register)


def _readings(real: np.ndarray, length: int) -> list[tuple[str, np.ndarray, int]]:
    """(layout, bool (B, L) real keys, tokens a step) of each way `length` keys lay the T steps of `real` (B, T)."""
    steps = real.shape[1]
    found = []
    for k in range(1, TOKENS + 1):
        if length == k * steps:
            found.append(("interleaved" if k > 1 else "one token a step", np.repeat(real, k, axis=1), k))
            if k > 1:
                found.append(("modality after modality", np.tile(real, (1, k)), k))
        elif k > 1 and length == k * steps - 1:  # (inference: the last step's action dropped)
            found.append(("interleaved", np.repeat(real, k, axis=1)[:, :length], k))
    return found


def _seen(cells: np.ndarray, real: np.ndarray) -> np.ndarray:
    """Bool (B, L, L): a real token's query that sees a padded token's key."""
    return cells & real[:, :, None] & ~real[:, None, :]


def padded_steps_attended(run: Run) -> list:
    """Self-attention calls of a model call whose real step tokens see tokens of steps the held step mask and the
    input's zeros call padding."""
    found, done = [], {}
    square = [call for call in run.unmasked if call.shape[2] == call.shape[3] > 1]
    for call in [*run.calls, *square]:
        top = run.top(call)
        if top is None or "step_padding" not in top.arguments or call.stored is None or cross(call) \
                or call.shape[2] != call.shape[3]:
            continue
        key = (call.mask, call.shape, id(top))
        if key not in done:
            done[key] = _finding(call, top)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, top) -> Finding | None:
    name, where, real, source = top.arguments["step_padding"]
    rows, length = call.shape[0], call.shape[3]
    cells = keep(call)
    readings = _readings(real, length)
    if cells is None or rows != real.shape[0] or cells.shape[0] not in (1, rows) or not readings:
        return None
    cells = np.broadcast_to(cells.any(axis=1), (rows, length, length))
    first = None
    for layout, keys, k in readings:
        bad = _seen(cells, keys)
        if not bad.any():
            return None  # (some layout the mask keeps to: said only where every one is seen through)
        first = first if first is not None else (layout, k, bad)
    layout, k, bad = first
    b, q, key_at = first_cell(bad)
    step = (lambda i: i // k) if layout != "modality after modality" else (lambda i: i % real.shape[1])
    pads = spans([int(s) for s in np.flatnonzero(~real[b])])
    return Finding("padded-steps-attended", (
        f"batch row {b}: query {q} (step {step(q)}, real) sees key {key_at} (step {step(key_at)}), a padded step: "
        f"{name} in {where} marks steps {pads} of that row as padding and the model call's `{source}` holds them as "
        f"exact zeros, {k} token{'s' if k > 1 else ''} a step ({layout}; {int(bad.sum())} such cells) — the step mask "
        f"never reached the attention"),
        expected="no token of a real step sees a token of a padded step", source=f"{name} in {where}",
        cell=(b, q, key_at))


RULES = (
    Rule("padded-steps-attended", "wrong", "call", "a trajectory model whose real step tokens see the tokens of steps "
         "its batch's step mask and its zero-padded input call padding (the step mask never handed to the attention: "
         "d3rlpy 9251cdeb)", padded_steps_attended),
)
