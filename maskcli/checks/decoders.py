"""A config that says its model is a decoder (`is_decoder=True`, not an encoder-decoder's whole), or a module of the
program's own class that says so of itself (trace/owndecoder.py), whose self-attention lets real queries see later real
keys.

`is_decoder=True` is how transformers' BERT family (BERT, RoFormer, BigBird, RemBert, MegatronBert, ...) and their
ports say the model runs as a causal LM (`XForCausalLM` sets it; `BertModel.forward` then builds a causal mask, not a
bidirectional one): its self-attention is causal, whatever else the model reads (transformers#48745: RoFormer built
`create_bidirectional_mask` unconditionally, so the causal LM saw the tokens it was trained to predict). The config
is read wherever the program keeps it (checks/intent.py: a transformers config, a dataclass, a dict), the innermost
that speaks for the call deciding (T5's decoder stack says True where its whole model's config says an
encoder-decoder). Not read: cross-attention (its keys are the encoder's), one query (a decode step sees every cached
key rightly), padding queries and keys (real.py), later keys the model call's token types account for (spans.py).
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, queries
from maskcli.checks.intent import intent, stated_for, transformers_config
from maskcli.checks.dropped import causal_word
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.checks.spans import explained
from maskcli.text import Finding


DECODER_PART = re.compile(r"(?:^|\.)decoder(?:\.|$|_)")  # a module path inside an encoder-decoder's decoder


def said_decoder(run: Run, call) -> str | None:
    """The source of `is_decoder=True` for `call`'s config, innermost first; None where none says it (or the innermost
    config that states anything says otherwise)."""
    top = run.top(call)
    if top is None:
        return None
    mine = [one for one in stated_for(top, call.where) if "causal_decoder" in one.fields]
    if not mine:
        return None
    inner = max(mine, key=lambda one: len(one.scope or "") if one.scope is not None else -1)
    if inner.scope is None and (getattr(top.config, "is_encoder_decoder", False) is True
                                and not DECODER_PART.search(call.where or "")
                                or transformers_config(top.config) and getattr(top.config, "is_decoder", None) is not True):
        return None  # (a program's text config, held by no module, speaks neither for a model call whose own config
        # says it is no decoder nor for an encoder-decoder's encoder: Pix2Struct's `Pix2StructTextConfig(is_decoder=True)`
        # is not its vision encoder's)
    return f"is_decoder=True ({inner.source})" if inner.fields["causal_decoder"] else None


def said_causal(run: Run, call) -> str | None:
    """`name=value (source)` where the program's own config states the call's self-attention causal (dropped.py's
    causal_word: is_causal=True, causal=True, attention_context_right=0, ...); None on cross-attention."""
    stated = intent(run, call)
    said = None if cross(call) else causal_word(run, call, stated)
    return None if said is None else stated.said(said)


def chunk_causal(later: np.ndarray, own: np.ndarray) -> bool:
    """Every later key a query sees (bool (B, Lq, Lk)) lies in the query's own chunk of some size c, two chunks at
    least over the queries (k // c == q // c): chunks that see themselves whole."""
    _, q, k = np.nonzero(later)
    return any(np.array_equal(k // c, own[q] // c) for c in range(2, len(own)))


def decoder_sees_later(run: Run) -> list:
    """Self-attention calls of a model its config calls a decoder where a real query sees a later real key."""
    found, done, judged = [], {}, None
    for call in run.calls:
        q_len, k_len = call.shape[2:]
        if call.stored is None or q_len < 2 or call.details.get("forward_not_causal"):
            continue  # (a pass whose module's forward was handed is_causal=False: the caller's own word, over the config's)
        said = said_decoder(run, call)
        causal = None if said is not None else said_causal(run, call)
        if said is None and causal is None:
            continue
        said = said or causal
        top = run.top(call)
        own = queries(call, top)
        key = (call.mask, call.shape, tuple(own), said, id(top))
        if key in done:
            if done[key] is not None:
                found.append((call, done[key]))
            continue
        done[key] = None
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, call.shape[0]):
            continue
        rows = by_row(cells, call.shape[0])
        real = resolve(call, top, rows)
        both = real.queries[:, :, None] & real.keys[:, None, :]  # (real query, real key)
        later = rows & (np.arange(k_len)[None, None, :] > own[None, :, None]) & both
        if not later.any() or causal and (np.array_equal(rows & both, np.broadcast_to(both, rows.shape))
                                          or chunk_causal(later, own)):
            continue  # (a stated causal word over a call that masks no real cell at all: dropped.py's to say; or
            # whose later keys are each query's own chunk's: a streaming encoder's chunk-causal, WeNet's causal=True)
        judged = explained(run) if judged is None else judged
        if call.index in judged:
            continue
        b, q, k = first_cell(later)
        words = (f"the program states its attention causal ({said}): the mask lets it see ahead" if causal else
                 f"the program says this model is a decoder ({said}): a causal LM whose self-attention is built "
                 f"bidirectional")
        done[key] = Finding("decoder-sees-later", (
            f"batch row {b}: query {int(own[q])} sees the later key {k}, yet {words} ({int(later.sum())} such cells)"),
            expected="causal", source=said, cell=(b, int(own[q]), k))
        found.append((call, done[key]))
    return found


RULES = (
    Rule("decoder-sees-later", "wrong", "steps", "a real query that sees a later real key in a model whose config says "
         "it is a decoder (is_decoder=True, not an encoder-decoder's whole config), or states its attention causal: "
         "its self-attention is causal",
         decoder_sees_later),
)
