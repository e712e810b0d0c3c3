"""A model that states itself a causal LM whose prompt pass attends both ways, and which then decodes over that cache;
or whose step of several new tokens behind its cache attends both ways (a verify step handed no mask, ipex-llm#11767).

The outermost module's class is named `...ForCausalLM` (transformers' contract for AutoModelForCausalLM: each
token predicts the next from the ones before it; trace/tops.py records the name). Its prompt pass (queries from
position 0, as many as keys) in which every real query sees every real key, later ones included, and whose keys the
same call site then extends one decode step at a time, wrote a cache no causal LM writes: the causal mask was dropped
on that path (transformers#48748: Doge's own dynamic mask under SDPA's is_causal skip; unsloth#2868: the SDPA fallback
called with is_causal=False). A site whose decode steps attend through a program function whose name says causal
(`causal_attention()`, trace/sites.py records it) states the layer causal the same way, where its prompt pass went
through another function (lablup/mlxcel#999: the generator's mask None handed to an unmasked SDPA), and so does the
attending module's own class name (`CausalSelfAttention`, checks/causalname.py: lag-llama#81's first cached forecast
run `is_causal=False`), whose model call may hand no token ids (a time series' features); a sliding cache's decode
steps keep as many keys as the prompt's. Left alone: a model call given token types, a prefix length or image positions, or one whose config or class
names a prefix-LM family (PaliGemma's: ai-edge-torch's port runs its image + prompt prefix both ways) (a prefix-LM or
an image block attends both ways on purpose: spans.py), a config that states the attention
bidirectional or its config `is_decoder=False` (RobertaForCausalLM run as an encoder, as transformers warns it
will), keys that are not the model call's own tokens (a vision tower inside the model), a video model that states its tokens
per frame whose calls take whole frames of queries (a frame attends both ways: CausVid's), and a prompt pass
any real query of which misses a real key (a mask was applied: the other rules judge it).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, queries
from maskcli.checks.intent import intent
from maskcli.checks.real import TOKENS, by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.checks.spans import FAMILIES, IMAGES, PREFIX, model_type
from maskcli.text import Finding

SPANS = ("token_type_ids", "mm_token_type_ids")  # image or prefix spans a model attends both ways on purpose


def _prompt(run: Run, call, top, own: bool = False) -> bool:
    """The call is the prompt pass over the model call's own tokens: square, from position 0, its keys the tokens.
    `own`: the attending layer names itself causal, so a model call given no token ids (a time series' float
    features, lag-llama's) is read too; where it is given ids, the keys must still be as many."""
    q_len, k_len = call.shape[2:]
    if q_len > k_len or q_len < 2 or (not _unwritten_after(call, q_len) if q_len < k_len else int(queries(call, top)[0]) != 0):
        return False  # (a static cache's prompt fills its first slots, whatever its position ids count from: OPT's pad + 1)
    tokens = next((top.arguments[n] for n in TOKENS if isinstance(top.arguments.get(n), np.ndarray)), None)
    if tokens is None and own and "first_ids" not in top.arguments:
        return True
    if tokens is None and own:
        tokens = top.arguments["first_ids"][1]  # (a hand-written forward(self, ids, ...)'s first argument)
    return tokens is not None and tokens.ndim == 2 and tokens.shape[1] == q_len


def _unwritten_after(call, q_len: int) -> bool:
    """A prompt pass into a static cache (fewer queries than keys): no query of any row or head keeps a key past the
    first q_len, the buffer's slots for later tokens (alpa's OPT serving cache); the prompt wrote those first slots."""
    cells = keep(call)
    return cells is not None and not cells[..., q_len:].any()


def _encoder(config, call) -> bool:
    """The program states this attention not causal though the class is named a causal LM: its config's own
    `is_decoder = False` (BERT-family configs, which RobertaForCausalLM reads: transformers warns "add is_decoder=True"
    and runs it both ways, as stated), or the attention module's `is_causal = False` as transformers' interface read it."""
    held = getattr(config, "__dict__", config if isinstance(config, dict) else {})
    told = call.details.get("hf") if isinstance(call.details.get("hf"), dict) else {}
    return held.get("is_decoder") is False or told.get("is_causal") is False or told.get("module_is_causal") is False


def _unmasked(run: Run) -> list:
    """The calls of each softmax site that masks nowhere (engine.py sets them apart) in step order, where an outermost
    module named a causal LM made them: a prompt pass handed no mask at all (transformers#30317: SDPA's mask None,
    meant for is_causal, handed to AWQ's fused attention, which adds a mask only where one is given)."""
    sites: dict = {}
    for call in run.unmasked:
        top = run.top(call)
        if call.api == "softmax" and call.stored is not None and top is not None and "causal_lm" in top.arguments \
                and not cross(call):  # (a cross-attention masks nowhere on purpose: its keys are the encoder's)
            sites.setdefault(call.where, []).append(call)
    return list(sites.values())


def both_ways(run: Run) -> list:
    """A ...ForCausalLM's prompt pass in which every real query sees every real key, decoded over afterwards."""
    found = []
    for calls, grows in [*((calls, 0) for calls in run.sites().values()), *((calls, 1) for calls in _unmasked(run))]:
        found += _steps_both_ways(run, calls)
        # (the site's first square call of two queries or more: a softmax of the program's own at the same module, a
        # cache compressor's scoring of the prompt's last queries (ipex-llm's SnapKV), may come before it)
        at = next((n for n, call in enumerate(calls) if call.shape[2] == call.shape[3] >= 2), 0)
        first, calls = calls[at], calls[at:]
        top = run.top(first)
        named = next((call.details["function_causal"] for call in calls[1:] if "function_causal" in call.details
                      and call.shape[2] < call.shape[3]), None) if "function_causal" not in first.details else None
        named = named or first.details.get("class_causal")  # (the layer's class: `CausalSelfAttention`)
        if named is None:  # (a layer whose forward builds the triangle where it has no cache: its first call handed one)
            at = next((n for n, call in enumerate(calls) if call.shape[2] >= 2 and "cache_branch_causal" in call.details), 0)
            first, calls = calls[at], calls[at:]
            top = run.top(first)
        branch = first.details.get("cache_branch_causal") if named is None else None  # (its forward's branch for no cache)
        named = named or branch
        if top is None or "causal_lm" not in top.arguments and named is None or first.stored is None:
            continue  # (most runs: no model that names itself a causal LM, no decode step through a causal function)
        if any(name in top.arguments for name in (*SPANS, *PREFIX, *IMAGES)) or prefix_lm(top) \
                or not _prompt(run, first, top, "causal_lm" not in top.arguments):
            continue
        k_len = first.shape[3]
        # (grows: a softmax site that masks nowhere must see its keys grow past the prompt's, as a cache's do; a
        # router's last axis, its experts, never grows)
        if not any(call.shape[2] < call.shape[3] and (call.shape[3] >= k_len + grows or not grows) for call in calls[1:]):
            continue  # no decode step over the prompt's cache (a sliding one keeps as many keys): one pass, or an
            # encoder run of the model
        if _open(run, first, top) or _frame_blocks(top, calls):
            continue
        read = _judged(first, top)
        if read is None:
            continue
        rows, real, judged = read
        q_len = first.shape[2]
        rows, judged = rows[..., :q_len], judged[..., :q_len]  # (a static cache's slots past the prompt: seen by none)
        later = np.arange(q_len)[None, None, :] > np.arange(q_len)[None, :, None]
        if not judged.any() or (judged & ~rows).any() or not (judged & later).any():
            continue
        b, q, k = first_cell(rows & judged & later)
        classed = named is not None and named == first.details.get("class_causal")
        said = f"{top.arguments['causal_lm']} states a causal LM" if "causal_lm" in top.arguments else \
            f"its attention module's class {named} states the layer causal" if classed else \
            f"{branch}, and this call was handed one" if branch is not None else f"its decode steps attend through {named}"
        found.append((first, Finding("causal-lm-both-ways", (
            f"{said}, but its prompt pass attends both ways: every real query "
            f"sees every real key (query {q} of batch row {b} sees later key {k}; {int((rows & judged & later).sum())} "
            f"such cells), and later steps decode over the cache it wrote (step {first.step})"),
            expected="causal", source=f"the model class {top.arguments['causal_lm']}" if "causal_lm" in top.arguments
            else f"the class {named} of {first.where}" if classed else branch if branch is not None
            else f"{named} at {first.where}'s decode steps",
            cell=(b, q, k))))
    return found


def prefix_lm(top) -> bool:
    """The model call states a prefix-LM family (spans.py's: PaliGemma's config or model class): its prompt is the
    prefix, which attends both ways on purpose, whether or not the call hands the token types that mark it."""
    family = FAMILIES.get(model_type(top.config, top))
    return family is not None and family.what == "prefix"


def _open(run: Run, call, top) -> bool:
    """The program states this attention both ways after all: its config (bidirectional) or its own is_decoder=False."""
    return intent(run, call).bidirectional() is not None or _encoder(top.config, call)


def _frame_blocks(top, calls: list) -> bool:
    """The model states its tokens per frame (a video generator: trace/framebudget.py) and every call of the site
    takes whole frames of queries: a frame, or a block of frames, attends both ways in a causal video model (CausVid,
    Self-Forcing), causal only from block to block."""
    said = next((one.fields["frame_budget"] for one in top.stated if "frame_budget" in one.fields), None)
    if said is not None and all(call.shape[2] % said[1] == 0 for call in calls):
        return True
    return all(call.shape[2] == calls[0].shape[2] for call in calls if call.shape[2] < call.shape[3])  # (or stated by
    # the steps themselves: every step behind the cache a block as large as the first pass, no token decoded alone:
    # MemFlow's frame blocks)


def _steps_both_ways(run: Run, calls: list) -> list:
    """A ...ForCausalLM's step of several new tokens behind its cache (a speculative or prompt-lookup verify step, a
    chunk of a prompt: its model call's token ids as many as the call's queries, fewer queries than keys) in which
    every real query sees every key, the later new tokens' included (ipex-llm#11767: the compressed cache's lookup
    step set attention_mask = None). Quiet where the model call attends the site twice (a split attention: the cache
    over one call, the new tokens over another, merged after), and where the program states the attention both ways."""
    found = []
    for call in calls:
        top = run.top(call)
        q_len, k_len = call.shape[2:]
        if top is None or "causal_lm" not in top.arguments or not 2 <= q_len < k_len or call.stored is None:
            continue  # (most calls: a prompt pass, a decode step of one token, or no causal LM)
        tokens = next((top.arguments[n] for n in TOKENS if isinstance(top.arguments.get(n), np.ndarray)), None)
        if tokens is None or tokens.ndim != 2 or tokens.shape[1] != q_len or \
                any(name in top.arguments for name in (*SPANS, *PREFIX, *IMAGES)):
            continue
        if sum(1 for other in calls if run.top(other) is top) != 1 or _open(run, call, top):
            continue
        read = _judged(call, top)
        if read is None:
            continue
        rows, real, judged = read
        if not real.queries[:, 0].any() or (judged & ~rows).any() or not real.keys[:, -1].any():
            continue  # (a query that misses a real key: a mask was applied, judged by the other rules)
        b = int(np.flatnonzero(real.queries[:, 0] & real.keys[:, -1])[0])
        found.append((call, Finding("causal-lm-both-ways", (
            f"{top.arguments['causal_lm']} states a causal LM, but its step {call.step} of {q_len} new tokens behind "
            f"the cache ({k_len - q_len} earlier keys) attends both ways: every real query sees every real key, so the "
            f"first new token of batch row {b} sees the last one's key {k_len - 1} ({int(judged.sum())} such cells, "
            f"none masked)"), expected="causal over the new tokens, placed after the cache's keys",
            source=f"the model class {top.arguments['causal_lm']}", cell=(b, k_len - q_len, k_len - 1))))
    return found


def _judged(call, top):
    """(rows: bool (B, Lq, Lk) cells kept in any head, real: its real queries and keys, judged: real query x real key)
    of one call; None where its cells are not kept."""
    cells = keep(call)
    if cells is None:
        return None
    rows = by_row(cells, call.shape[0] if cells.shape[0] in (1, call.shape[0]) else None)
    real = resolve(call, top, rows)
    return rows, real, real.queries[:, :, None] & real.keys[:, None, :]


RULES = (
    Rule("causal-lm-both-ways", "wrong", "site", "a model named ...ForCausalLM (or a layer whose class or decode function "
         "is named causal) whose prompt pass attends both ways (every "
         "real query sees every real key) and then decodes over that cache, or whose step of several new tokens behind "
         "its cache (a verify step) does: a causal mask dropped on that path", both_ways),
)
