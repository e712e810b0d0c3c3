"""Causality asked per call by a word handed to the module's forward, and present where the word was not handed.

A module that takes its future mask as a word of the call (`self_attention(x, x, x, mask="subsequent")` on the
decoder's self-attention, `mask=None` on the encoder's and on the cross-attention: maxjcohen/transformer's
MultiHeadAttention) states with every call whether that call is causal. trace/askedcausal.py records the word (class,
parameter, string or None) of each call. Where calls of one class and parameter that asked (a string naming the future:
subsequent, causal, future, triangular, look-ahead) are causal and a call of it that did not ask hides, in every batch
row, every later key of every query too (and some query sees an earlier key: a triangle, not a diagonal), the
causality reached the calls that never asked for it (maxjcohen/transformer 60df0da: `generate_local_map_mask(K,
attention_size, self._scores.device)` put the device in the `mask_future` slot, a truthy value, so the symmetric local
window became a causal one everywhere). Said once per class and parameter, on its first such call, self-attention first.
Quiet: no call of the class asked, or the calls that asked are not causal (the word does something else), or the calls
that did not ask see a later key in some row (the fix's symmetric window).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, band, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

WORDS = ("subsequent", "causal", "future", "triang", "look_ahead", "lookahead", "autoregress")


def _asks(value) -> bool:
    return isinstance(value, str) and any(word in value.lower() for word in WORDS)


def _causal(call) -> bool | None:
    """Every batch row of a square call hides every key after each query, and some query sees an earlier key; None
    where its cells are not known."""
    q_len, k_len = call.shape[2:]
    cells = keep(call) if q_len == k_len and q_len > 1 else None
    if cells is None:
        return None
    later = band(q_len, k_len, 1, True)
    earlier = band(q_len, k_len, -1, False)
    return not (cells & later).any() and bool((cells & earlier).any())


def unasked_causal(run: Run) -> list:
    """The first call per (class, parameter) that did not ask for causality yet is causal, where those that asked are."""
    words: dict[tuple, dict] = {}
    for call in run.calls:
        word = call.details.get("forward_word")
        if isinstance(word, (tuple, list)) and len(word) == 3 and call.stored is not None:
            words.setdefault((word[0], word[1]), {True: [], False: []})[_asks(word[2])].append((call, word[2]))
    found = []
    for (owner, name), said in words.items():
        asked, unasked = said[True], said[False]
        if not asked or not unasked or not all(_causal(call) for call, _ in asked):
            continue
        hits = [(call, value) for call, value in sorted(unasked, key=lambda one: cross(one[0])) if _causal(call)]
        if not hits:
            continue
        call, value = hits[0]
        word = asked[0][1]
        q_len = call.shape[2]
        found.append((call, Finding("causal-unasked", (
            f"{call.where}: {owner}.forward takes the future mask as a word of the call ({name}={word!r} on "
            f"{asked[0][0].where}), and this call was handed {name}={value!r}, yet it hides every later key of each of "
            f"its {q_len} queries in every batch row ({len(hits)} such calls of {len(unasked)} that did not ask): "
            f"the causal part reached calls that never asked for it (applied whatever the word: a truthy value in a "
            f"mask_future slot, `if mask == 'causal' or 'future'`?)"),
            expected="not causal", source=f"{owner}.forward({name}={word!r})", cell=(0, 0, 1))))
    return found


RULES = (
    Rule("causal-unasked", "wrong", "steps", "a module that takes causality as a word of each call (mask="
         "\"subsequent\") runs causal on the calls that did not ask for it", unasked_causal),
)
