"""An ALiBi bias that rewards distance: the program names its bias ALiBi, and the farther a key the larger its bias.

ALiBi (Press et al., "Train Short, Test Long") adds `-m * |i - j|` to each score, `m > 0` a slope per head: the
farther a key from its query, the lower its score, and no head's bias ever rises with distance. A bias the program
calls ALiBi (its FlexAttention score_mod's name: `alibi_mod`, `alibi_bias`) is read per head and distance on the cells
the call keeps (trace/flexbias.py, details["position_bias"]: each query row less its value at its own key); where a
head's bias over the distances it sees rises with the distance (every step farther adds to it, some strictly) the
bias has the wrong sign: each query favours the keys farthest from it (attention-gym#86: `(q_idx - kv_idx) * scale`
under a causal mask, fixed to `(kv_idx - q_idx)`). Quiet where it falls with distance (ALiBi), where it is flat, where
it is not a function of distance alone, and on a bias not named ALiBi (a learned relative bias may rise anywhere).
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding

ALIBI = re.compile(r"alibi", re.IGNORECASE)


def alibi_rising(run: Run) -> list:
    """Calls whose bias is named ALiBi and rises with the distance in some head: wrong, once a site."""
    found, done = [], set()
    for call in run.calls:
        name = call.details.get("score_mod_name") or ""
        profile = call.details.get("position_bias")
        if not ALIBI.search(name) or not profile or "low" not in profile or call.where in done:
            continue
        rising = _rising(profile)
        if rising is None:
            continue
        head, near, far = rising
        done.add(call.where)
        found.append((call, Finding("alibi-rewards-distance", (
            f"head {head}: the score_mod {name} adds {far[1]:.4g} at distance {far[0]} and {near[1]:.4g} at distance "
            f"{near[0]} (each query row less its bias at its own key): the farther key gets the larger bias, where ALiBi "
            f"subtracts slope * distance, so each query favours the keys farthest from it (the distance added where "
            f"it is subtracted: its sign turned?)"),
            expected="a bias that falls with the distance (-slope * |q - k|)", source=f"the score_mod's name ({name})")))
    return found


def _rising(profile: dict):
    """(head, (nearest distance, its bias), (farthest, its bias)) of the first head whose bias, a function of distance
    (low == high wherever seen), never falls as |k - q| grows and rises somewhere; None where none does."""
    low, high = (np.array([[np.nan if v is None else v for v in row] for row in profile[key]]) for key in ("low", "high"))
    width = low.shape[1] // 2
    distance = np.arange(low.shape[1]) - width
    for head in range(low.shape[0]):
        seen = np.isfinite(low[head]) & (distance != 0)
        if seen.sum() < 2 or not np.allclose(low[head][seen], high[head][seen], atol=1e-6):
            continue
        for side in (distance < 0, distance > 0):
            at = np.flatnonzero(seen & side)
            if len(at) < 2:
                continue
            order = at[np.argsort(np.abs(distance[at]))]
            values = low[head][order]
            steps = np.diff(values)
            if (steps >= -1e-6).all() and (steps > 1e-6).any() and values[0] > -1e-6:
                return head, (int(distance[order[0]]), float(values[0])), (int(distance[order[-1]]), float(values[-1]))
    return None


RULES = (
    Rule("alibi-rewards-distance", "wrong", "call", "a bias the program names ALiBi that rises with the key's distance "
         "from the query (its sign turned: the farthest keys favoured)", alibi_rising),
)
