"""What the program said of its attention that never reached the kernel: a causal flag in its config, a mask it handed in.

- A function that attends was handed an additive mask over exactly its (Lq, Lk) as a parameter (`attn_mask`,
  `attention_mask`, `mask`, `attn_bias`: it, its caller or theirs; trace/given.py), and the kernel it called sees
  cells that mask masks, on rows the mask leaves some key: the mask was dropped on the way (VeOmni#1051: the
  flash-attn path calls `flash_attn_func(q, k, v, causal=causal)` and the entity masks never apply). A mask the
  kernel keeps to, with more masked on top (a causal part, a window), is quiet; so is a row the mask masks whole
  (transformers unmasks those on purpose), and a bool mask (its polarity is not known at that frame).

- A config the program states its attention in (checks/intent.py: a dataclass, a dict, a namespace, an export
  wrapper's options, wherever it keeps them) says the attention is causal (`is_causal=True`, `causal=True`,
  `force_causal_mask=True`), yet a call with several queries masks nothing on its real queries and keys: each query
  sees the keys after it (torch-to-nnef#217: the forced causal mask sized from the KV cache's batch axis, a
  [1, 1, 1, 1] zero mask that broadcasts to "attend everything"). Said *wrong* where every call the statement
  speaks for is so; *suspicious* where others of them are causal (the flag may be said of one part, a decoder
  beside its vision tower), unless those are calls of the same site (the very layer, causal in another model call:
  TEI's Qwen3 left an equal-length batch unmasked, its single texts causal). Left alone: a config that states the attention both ways too, an encoder-decoder's
  (`is_decoder`), transformers' own configs (their `is_causal` is a class's default for one part), later keys the
  model call's token types account for, one query (a decode step sees every cached key rightly), queries no more than
  a chunk the streaming model states beside its causal flag (own.one_chunk: a chunk sees itself whole). A field the program
  set itself on the innermost transformers config of the call, which its class defines nowhere (`config.is_causal =
  True` on a ModernBertConfig, whose layers attend both ways: BONSAI#343), is the program's word and read.
"""

from __future__ import annotations

from maskcli.checks.config import _each_layer_call, _layer, _layer_calls
from maskcli.checks.context import Run, cross, first_cell
from maskcli.checks.own import one_chunk
from maskcli.checks.registry import Rule
from maskcli.checks.spans import explained
from maskcli.text import Finding


def causal_word(run: Run, call, stated) -> str | None:
    """The field of `stated` (the call's Intent) that says its attention is causal, where that is the program's word:
    not an encoder-decoder's, nor transformers' class default (unless the program set it on the layer's own config:
    configread.py), nor against the attending module's own causal=False (which speaks for itself, save against the
    program's word on the very config its layers are built from), nor a streaming chunk that sees itself whole."""
    said = stated.causal()
    own = said in stated.added
    if said is None or stated.decoder or stated.transformers and not own \
            or call.details.get("module_not_causal") and not own or one_chunk(run, call):
        return None
    return said


def causal_ignored(run: Run) -> list:
    """A call whose config states it causal but that masks nothing on its real queries and keys (several queries)."""
    judged = None
    full, causal = [], {}
    for call, stated, index, kind, placed in [*_each_layer_call(run), *_never_masked(run)]:
        said = causal_word(run, call, stated)
        if said is None or call.shape[2] < 2:
            continue
        source = stated.said(said)
        if placed.holds("causal"):
            causal.setdefault(source, set()).add(call.where)
            continue
        if not placed.holds("full"):
            continue  # (a window, documents, spans: the rules that can name them)
        later = placed.seen & placed.judged & (placed.keys[None, :] > placed.own[:, None])[None, None]
        if not later.any():
            continue
        judged = explained(run) if judged is None else judged
        if call.index not in judged:
            full.append((call, index, said, source, placed, later))
    found = []
    for call, index, said, source, placed, later in full:
        if any(call is one for one in run.unmasked) and (source in causal or not stated_sure(said, run, call)):
            continue  # (a site that masks nowhere, beside causal calls the word speaks for: a vision tower's, say)
        b, _, q, k = first_cell(later)
        # (causal calls of this very site: the word speaks for this layer, which runs causal in another model call)
        sure = (source not in causal or call.where in causal[source]) and stated_sure(said, run, call)
        found.append((call, Finding("causal-config-ignored", (
            f"{_layer(index, call)} lets each of its {call.shape[2]} queries see the later keys, but the program states its "
            f"attention causal ({source}): query {int(placed.own[q])} sees later key {k} "
            f"({int(later.any(axis=1).sum())} such cells)" + ("" if sure else (
                f", unless {said} is said of another part" + (" (other calls it speaks for are causal)"
                                                              if source in causal else "")))),
            severity=None if sure else "suspicious", expected="causal", source=source,
            cell=(b, int(placed.own[q]), k))))
    return found


def _never_masked(run: Run) -> list:
    """config.py's layer calls of the square softmax sites that mask nowhere (engine.py sets them apart as `unmasked`:
    a softmax may be a router's): an attend function built without its causal flag masks nothing at any call
    (dreamer4#2's encoder attend fn); read where the program states a config, for causal-config-ignored alone."""
    square = [call for call in run.unmasked if call.api == "softmax" and call.shape[2] == call.shape[3] > 1]
    if not square or not any(top.stated for top in run.tops):
        return []
    return list(_layer_calls(Run(square, run.tops)))


def mask_dropped(run: Run) -> list:
    """A call whose kernel sees cells of the additive mask the program handed to the function that attends (trace/given.py)."""
    found, done = [], set()
    for call in [*run.calls, *run.cross]:  # (a cross-attention's handed mask is the program's word as much)
        lost = call.details.get("dropped_mask")
        if not lost or (call.mask, lost["name"]) in done or cross(call) and (
                "(bool" in lost["name"] and not lost.get("queries_by_keys") or lost.get("beside_memory_mask")):
            continue  # (a cross-attention's frames hold the queries' own bool mask too: only an additive one is read,
            # or a bool one over its own (Lq, Lk) of two lengths, which no self-attention of the queries is: hepattn#148;
            # and none of a layer that takes its memory's mask beside it by name: fairseq's self_attn_mask, trace/given.py)
        if "over_weights" in call.details:
            continue  # (a softmax over an earlier one's weights, whose scores the mask reached: checks/weighted.py)
        done.add((call.mask, lost["name"]))
        b, h, q, k = lost["cell"]
        if lost.get("cast"):
            found.append((call, Finding("mask-argument-dropped", (
                f"{call.where} was handed an additive bias ({lost['name']}: finite values it adds to the scores), but "
                f"its {call.api} masks {lost['cells']} cells the bias keeps (batch row {b}, head {h}, query {q}, key "
                f"{k}) and keeps exactly those where the bias is {'0' if lost['cast'] == 'masked' else 'not 0'}: the bias "
                f"was read as a bool mask on its way to the kernel (nonzero = {lost['cast']}), not added"),
                expected=lost["name"], source=lost["name"], cell=(b, q, k))))
            continue
        found.append((call, Finding("mask-argument-dropped", (
            f"{call.where} was handed a mask ({lost['name']}, {lost['masked']} cells masked on rows it leaves some key), "
            f"but its {call.api} sees {lost['cells']} of those cells (batch row {b}, head {h}, query {q}, key {k}): "
            + ("the mask was inverted on its way to the kernel: on every row it keeps some keys of, the kernel keeps "
               "exactly the cells it masks and masks the ones it keeps" if lost.get("inverted") else
               f"only batch row {lost['one_row']}'s mask reached the kernel: every batch row is attended with it, while "
               "the mask handed in differs by batch row" if lost.get("one_row") is not None else
               "the mask was dropped on its way to the kernel")), expected=lost["name"], source=lost["name"],
            cell=(b, q, k))))
    return found


def stated_sure(said: str, run: Run, call) -> bool:
    """The causal statement is about attention: is_causal / force_causal_mask, or `causal` in a config that names
    attention fields (heads, attn); an RNN's or a convolution's `causal` is not."""
    from maskcli.checks.intent import GENERAL, intent

    return said not in GENERAL or intent(run, call).attention


RULES = (
    Rule("mask-argument-dropped", "wrong", "call", "an additive mask handed to the function that attends (attn_mask, "
         "attention_mask, mask, attn_bias) whose masked cells the kernel sees: dropped on its way (a flash path)",
         mask_dropped),
    Rule("causal-config-ignored", "wrong", "steps", "a call whose config states the attention causal (is_causal, "
         "causal, force_causal_mask, use_bidirectional_attention=False) but that masks nothing: every query sees the later keys", causal_ignored),
)
