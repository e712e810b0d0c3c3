"""Attention that runs in another direction than the program states: causal where it says both ways, or the reverse.

- A module whose own attribute says it is not causal (`self.is_causal = False`, `self.causal = False`: trace records
  it on each call the module makes, trace/sites.py causal_flag) runs causal on one call over its own tokens, while
  another call of the same module (the same site and caller) lets real queries see later real keys: its calls
  disagree, and the module states which is meant (llm2vec#74: LlamaBiModel's SDPA shortcut returned no mask for an
  unpadded batch of one, and transformers 4.40 then ran SDPA with `is_causal=True`; a padded batch got the
  bidirectional mask). Left alone: a site some call of which a running module's forward was handed `is_causal=True`
  / `causal=True` (GritLM chooses the direction per call: trace/sites.py records it beside the module's False),
  later keys the model call's token types account for, one query, cross-attention.
  Where no call of the site attends both ways, the module's word stands against a kernel the module itself hands
  causal: `is_decoder=False` (or is_causal / causal False) and sdpa's `is_causal=True` or flash's `causal=True`, every
  real query seeing only the keys up to itself (OpenNMT#2464: every "self" attention, the encoder's included, took
  SDPA's `is_causal=(mask is not None)` and dropped the source padding mask). A mask the program built causal and
  handed in is no kernel flag, and is left alone (a BERT run as an LM with a causal attention mask); so is a call the
  model made through a transformers attention function handed `is_causal=True` itself (CLIP's text tower: its
  CLIPAttention class says False, the vision tower's default, and the text model overrides it per call).
- A decoder's self-attention over its own tokens in which a real query sees a later real key, where the program's
  own decoder class (named a decoder, in the program's files) has a causal-mask builder in its code (ESPnet's
  `subsequent_mask`, fairseq's `buffered_future_mask`, `generate_square_subsequent_mask`: trace/builders.py): the
  program builds its decoder causal, and this mask never got that part (espnet#1539: ESPnet2's TransformerDecoder
  built `tgt_mask` from the target lengths alone). Left alone: a decoder some running module's forward was handed
  `is_causal=False` against its default (GritLM embeds bidirectionally with the causal LM's own model:
  trace/forwardflag.py said_both_ways), a decoder that names itself not autoregressive
  (an MLM / NAR decoder), a library's decoder (DETR runs torch's without a causal mask), a config that states the
  attention both ways, later keys token types account for, one query, cross-attention (checks/context.crossing).
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, queries
from maskcli.checks.intent import intent
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.checks.spans import explained
from maskcli.text import Finding

ATTENTION = re.compile(r"attn|attention", re.IGNORECASE)  # a module named as an attention (`self_attn`, `attn`)


def pass_directions(run: Run, call):
    """(later, causal, missed) of a call over its own tokens from position 0: bool (B, Lq, Lk) real queries seeing
    later real keys, whether every real query sees exactly the real keys up to itself, bool (B, Lq, Lk) the later real
    keys real queries miss; None where the call is not such a pass or its cells are not kept."""
    q_len, k_len = call.shape[2:]
    if call.stored is None or q_len < 2 or cross(call):
        return None
    top = run.top(call)
    own = queries(call, top)
    if int(own[0]) != 0 or q_len != k_len:
        return None
    memo = run.__dict__.setdefault("_directions", {})  # (the layers of a pass hand one mask: read once per mask and
    key = (call.mask, call.shape, id(top), own.tobytes())  # placing, as resolve reads it: the model call's statement)
    if key not in memo:
        memo[key] = read_directions(call, top, own)
    return memo[key]


def read_directions(call, top, own: np.ndarray):
    """pass_directions' (later, causal, missed) of a call whose queries sit at `own`, read on its real queries and keys
    (steps.py reads a chunk behind cached keys so); None where its cells are not kept or nothing real meets."""
    k_len = call.shape[3]
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, call.shape[0]):
        return None
    rows = by_row(cells, call.shape[0])
    real = resolve(call, top, rows)
    judged = real.queries[:, :, None] & real.keys[:, None, :]
    if not judged.any():
        return None
    ahead = np.arange(k_len)[None, None, :] > own[None, :, None]
    later = rows & judged & ahead
    causal = bool(((rows & judged) == (judged & ~ahead)).all())
    return later, causal, judged & ahead & ~rows


def causal_run_unsaid(run: Run) -> list:
    """Calls of a module that says it is not causal run causal where another of its calls attends both ways."""
    found = []
    for (where, _), calls in run.callers().items():
        said = next((call.details["module_not_causal"] for call in calls if call.details.get("module_not_causal")), None)
        if said is None:
            continue  # (most sites: no module that says it is not causal; one call is judged by _flagged alone)
        judged = None
        if any(call.details.get("forward_causal") for call in calls):
            continue  # a forward around the module handed causal=True on some call: the direction is chosen per call
        read = [(call, pass_directions(run, call)) for call in calls if call.details.get("module_not_causal") == said]
        read = [(call, got) for call, got in read if got is not None]
        both = next(((call, got) for call, got in read if got[0].any()), None)
        if both is None:
            found.extend(_flagged(run, where, said, read))
            continue
        for call, (later, causal, missed) in read:
            if not causal or later.any() or not missed.any():
                continue
            judged = explained(run) if judged is None else judged
            if call.index in judged or both[0].index in judged:
                continue
            b, q, k = first_cell(both[1][0])
            mb, mq, mk = first_cell(missed)
            found.append((call, Finding("causal-but-said-not", (
                f"{where}'s module states {said.split('.')[-1]}=False ({said}) and its call at step {both[0].step} "
                f"attends both ways (batch row {b}: query {q} sees later key {k}), yet at step {call.step} its "
                f"({call.shape[0]}, {call.shape[2]}, {call.shape[3]}) pass runs causal: every real query sees only "
                f"the keys up to itself (batch row {mb}: query {mq} misses key {mk}): a causal mask on this batch "
                f"shape only" + (" (the kernel's is_causal, taken from a mask left out?)" if call.details.get("is_causal")
                                 else "")),
                expected="bidirectional", source=f"{said}=False", cell=first_cell(missed))))
    return found


def _flagged(run: Run, where: str, said: str, read: list) -> list:
    """The first call of a site whose module says it is not causal, none of whose calls attends both ways, where the
    kernel was handed is_causal=True and every real query sees only the keys up to itself (OpenNMT#2464)."""
    for call, (later, causal, missed) in read:
        flag = call.details.get("is_causal") is True or "function" in call.details and call.details.get("causal") is True
        if not flag or not causal or later.any() or not missed.any():  # (sdpa's is_causal, flash_attn_func's causal)
            continue
        if (call.details.get("hf") or {}).get("is_causal") is True:
            continue  # (the model handed its transformers attention function is_causal=True for this call: the
            # module's attribute is a default the model overrides per call, CLIP's text tower over a class its vision
            # tower runs both ways)
        if call.index in explained(run):
            return []
        mb, mq, mk = first_cell(missed)
        return [(call, Finding("causal-but-said-not", (
            f"{where}'s module states {said.split('.')[-1]}=False ({said}), yet its {call.api} is called "
            f"causal (is_causal=True): its ({call.shape[0]}, {call.shape[2]}, {call.shape[3]}) pass at step {call.step} runs "
            f"causal, every real query sees only the keys up to itself (batch row {mb}: query {mq} misses key {mk})"),
            expected="bidirectional", source=f"{said}=False", cell=(mb, mq, mk)))]
    return []


def _self_by_inputs(call) -> bool:
    """The attending layer's forward was handed its queries' own tensor as its keys (trace/crossing.py's "inputs")."""
    read = call.details.get("cross")
    return isinstance(read, dict) and read.get("by") == "inputs" and read.get("cross") is False


def decoder_builder_unused(run: Run) -> list:
    """Self-attention calls of a program's decoder that holds a causal-mask builder where a real query sees later."""
    found, done, judged = [], set(), None
    # (a softmax site that masks nowhere is set apart from run.calls (engine.py): a decoder's self-attention that got no
    # mask at all is one, read where its module is named an attention's, or where the layer around it was handed its
    # queries' own tensor as its keys: nlp-tutorial's `MultiHeadAttention(Q, K, V)` around an inline nn.Softmax())
    bare = [call for call in run.unmasked if call.api == "softmax" and (ATTENTION.search(call.where.split(".")[-1])
                                                                         or _self_by_inputs(call))]
    for call in run.calls + bare:
        said = call.details.get("decoder_builder")
        if said is None or call.details.get("module_not_causal") or call.details.get("forward_not_causal"):
            continue  # (a module that says it is not causal, or a forward around the call handed causal=False: GritLM's)
        key = (call.mask, tuple(call.shape), said)
        if key in done:
            continue
        done.add(key)
        got = pass_directions(run, call)
        if got is None or not got[0].any():
            continue
        if intent(run, call).bidirectional() is not None:
            continue
        judged = explained(run) if judged is None else judged
        if call.index in judged:
            continue
        later = got[0]
        b, q, k = first_cell(later)
        found.append((call, Finding("decoder-mask-not-causal", (
            f"batch row {b}: query {q} of {call.where} sees the later key {k} ({int(later.sum())} such cells), yet the "
            f"program's decoder builds causal masks ({said}): its self-attention's mask never got the "
            f"causal part (the padding mask alone, or none)"),
            expected="causal", source=said, cell=(b, q, k))))
    return found


RULES = (
    Rule("causal-but-said-not", "wrong", "site", "a module that states itself not causal (is_causal=False, "
         "is_decoder=False) runs causal where another call of the same site attends both ways (a kernel's is_causal "
         "taken from a missing mask on one batch shape), or where it hands its kernel is_causal=True", causal_run_unsaid),
    Rule("decoder-mask-not-causal", "wrong", "call", "a decoder of the program's own whose code holds a causal-mask "
         "builder (subsequent_mask, buffered_future_mask) lets a real query of its self-attention see a later real "
         "key: the causal part never reached the mask", decoder_builder_unused),
)
