"""A generation loop that re-runs its whole sequence, one token longer each call, through a decoder that sees later tokens.

A greedy or sampling loop written without a cache calls the model on all its tokens every step: step t's ids are step
t-1's plus the token it chose (candle's BLIP captioning example, `TextLMHeadModel.forward(input_ids, image_embeds)`
called on the caption so far). That loop states the model is autoregressive over the tokens it appends: a token the
loop appended was chosen from what came before it, so no token may see one appended after it, and no prompt token may
see an appended one (a prefix-LM's prompt, bidirectional among itself, is left alone). Read where the same outermost
module is called three times or more in a row on token ids (`input_ids`, `idx`, `tokens`, the first ids it takes)
that each extend the last by one token in every batch row, and the model states it decodes (its name says decoder, LM
head, causal LM, language model, GPT, caption or generate, but not a masked LM's: BERT filling a [MASK] it appends each
step sees both ways; its config `is_decoder`; or it makes a cross-attention to a memory, as a captioner or a speech
decoder does): at each later call, a self-attention whose real query sees a later real key that the loop
appended is wrong (candle#1146: the BLIP text decoder's self-attention had no mask; the fix adds -inf above the
diagonal). Quiet where the model is causal, on the prompt's own bidirectional block, on a loop that appends more than
one token a call (a diffusion LM's blocks) or changes earlier tokens, and on a cached loop (one query a call). The keys
are the loop's tokens where they grow with its ids, behind a fixed prefix (GIT's image tokens before its text, so its
appended tokens start past them); a vision tower run again each step over the same image attends none of them.
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, queries
from maskcli.checks.real import by_row, handed_ids, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding

DECODES = re.compile(r"decoder|(?<!m)lmhead|causallm|languagemodel|gpt|caption|generat", re.IGNORECASE)  # (not MaskedLM, XLM)
STEPS = 3  # model calls in a row at least, each one token longer


def _ids(top) -> np.ndarray | None:
    said = handed_ids(top.arguments)
    return said[1] if said is not None and said[1].size else None


def _loops(run: Run) -> list[tuple[int, list]]:
    """(the first call's length, the tops of the loop after its first) of each run of STEPS or more calls of one
    module whose ids extend the last call's by one token."""
    found, chain = [], []  # (chain: (top, its ids) of the run so far)
    for top in [*run.tops, None]:
        ids = None if top is None else _ids(top)
        last = chain[-1][1] if chain else None
        if ids is not None and last is not None and top.where == chain[-1][0].where \
                and ids.shape == (last.shape[0], last.shape[1] + 1) and np.array_equal(ids[:, :-1], last):
            chain.append((top, ids))
            continue
        if len(chain) >= STEPS:
            found.append((chain[0][1].shape[1], [t for t, _ in chain[1:]]))
        chain = [] if ids is None else [(top, ids)]
    return found


def _decodes(run: Run, top) -> bool:
    """The model says it decodes: its name, its config's `is_decoder`, a cross-attention it makes."""
    if DECODES.search(top.where or "") or getattr(top.config, "is_decoder", False) is True:
        return True
    return any(top.first <= call.index < top.end for call in run.cross)


def _offsets(run: Run, tops: list) -> dict:
    """{site: d} of each site whose keys are the loop's tokens behind a fixed prefix of d keys (GIT's image tokens
    before its text): at every call of the loop, as many keys as the call's ids plus d. A site whose keys do not grow
    with the ids (a vision tower run again each step over the same image) attends no appended token."""
    seen: dict = {}
    for top in tops:
        length = _ids(top).shape[1]
        for call in (c for c in (*run.calls, *run.unmasked) if top.first <= c.index < top.end):
            seen.setdefault(call.where, set()).add(int(call.shape[3]) - length)
    return {where: d.pop() for where, d in seen.items() if len(d) == 1 and min(d) >= 0}


def loop_sees_later(run: Run) -> list:
    """Self-attention calls of a re-run generation loop where a real query sees a later real key the loop appended."""
    found, done = [], set()
    for start, tops in _loops(run):
        if not _decodes(run, tops[0]):
            continue
        offsets = _offsets(run, tops)
        for top in tops:
            for call in [c for c in (*run.calls, *run.unmasked) if top.first <= c.index < top.end]:  # (no mask at all:
                q_len, k_len = call.shape[2:]  # a site that masks nowhere is among run.unmasked)
                offset = offsets.get(call.where)
                if call.where in done or q_len != k_len or offset is None or q_len <= offset + start or cross(call) \
                        or call.stored is None:
                    continue
                cells = keep(call)
                if cells is None or cells.shape[0] not in (1, call.shape[0]):
                    continue
                own = queries(call, top)
                if not np.array_equal(own, np.arange(q_len)):
                    continue
                rows = by_row(cells, call.shape[0])
                real = resolve(call, top, rows)
                column = np.arange(k_len)
                later = rows & (column[None, None, :] > own[None, :, None]) & (column >= offset + start)[None, None, :] \
                    & real.queries[:, :, None] & real.keys[:, None, :]
                if not later.any():
                    continue
                done.add(call.where)
                b, q, k = first_cell(later)
                found.append((call, Finding("loop-sees-later", (
                    f"batch row {b}: query {q} sees the later key {k}, a token the generation loop appended: "
                    f"{top.where} is called on its whole sequence again each step, one token longer (ids of {start} token{'' if start == 1 else 's'}"
                    f", then {start + 1}, {start + 2}, ...), so each token it appends is chosen from the tokens "
                    f"before it, yet here a token's state depends on tokens appended after it ({int(later.sum())} such "
                    f"cells): the decoder's self-attention needs a causal mask"),
                    expected="causal over the appended tokens", source="the generation loop: each call's ids the last "
                    "call's plus one token", cell=(b, q, k))))
    return found


RULES = (
    Rule("loop-sees-later", "wrong", "steps", "a generation loop that re-runs its whole sequence one token longer each "
         "call, through a decoder whose self-attention lets a token see a later appended one", loop_sees_later),
)
