"""A conditioned decoder whose generation never hands it the conditioning its caller holds: no step attends it.

A model's forward that takes `encoder_hidden_states` (or `encoder_outputs`, `conditioning`, `prompt_embeds`...:
trace/heldinput.py) attends them: as cross-attention memory, or fused as a prefix of its own self-attention, whose
keys a cache then keeps for the later steps. Where the function that calls the model holds such a tensor under that
very name, and no call of the model in the run is handed it, the first call included, though that first call is a
fresh pass (its queries from position 0, its keys its own tokens: an empty cache that holds no prefix), and the later
calls decode over the cache it wrote, no attention call of the generation ever sees the conditioning: every decoded
token attends only the decoded tokens (transformers#48679, MusicGen-Melody: once generate pre-created an empty
DynamicCache, prepare_inputs_for_generation's `past_key_values is not None` guard dropped `encoder_hidden_states`
already at step 0). Quiet where any call of the model was handed it (the prefix in the cache, or a memory at each
step), where an attention call of the model attends keys that are not its own tokens (a memory reached it some other
way), where the first call reads a cache (the conditioning may be in it already), and where the first pass holds as
many keys as the conditioning has positions or more (the caller may have fused it into the inputs itself).
"""

from __future__ import annotations

from maskcli.checks.context import Run, cross, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def never_handed(run: Run) -> list:
    """A model whose calls never get the conditioning its caller holds, its first call a fresh pass, later ones cached."""
    found, by_model = [], {}
    for top in run.tops:
        if "input_withheld" in top.arguments or "input_handed" in top.arguments:
            by_model.setdefault(top.where, []).append(top)
    for where, tops in by_model.items():
        if len(tops) < 2 or any("input_withheld" not in top.arguments for top in tops):
            continue  # (handed at some call: the conditioning reached the model; or one call, no generation)
        every = sorted({id(c): c for c in (*run.calls, *run.cross, *run.unmasked)}.values(), key=lambda c: c.index)
        # (a softmax site that masks nowhere, as a decode step's over its cache does, and a cross-attention are
        # set apart from run.calls by engine.py: each is a call of the model all the same)
        calls = [[call for call in every if top.first <= call.index < top.end and run.top(call) is top] for top in tops]
        if not all(calls) or any(cross(call) for made in calls for call in made):
            continue  # (a call that attends a memory: the conditioning, or some other, reached it)
        first = calls[0][0]
        q_len, k_len = first.shape[2:]
        if q_len != k_len or int(queries(first, tops[0])[0]) != 0:
            continue  # (the first call reads a cache: the conditioning may be in it)
        if not any(call.shape[3] > k_len for call in calls[-1]):
            continue  # (no later step decodes over the first pass's cache)
        name, held, shape = tops[0].arguments["input_withheld"]
        if k_len >= shape[1]:
            continue  # (as many keys as the conditioning's positions: the caller may have fused it in itself)
        found.append((first, Finding("conditioning-never-attended", (
            f"the forward of {where} takes `{name}`, and {held} holds it {shape}, but none of the model's {len(tops)} "
            f"calls was handed it, the first included: a fresh pass whose cache is empty ({q_len} "
            f"quer{'y' if q_len == 1 else 'ies'} over {k_len} key{'' if k_len == 1 else 's'}, its own tokens), so no "
            f"attention call of the generation sees the conditioning: query 0 of batch row 0 sees key 0, its own "
            f"token, and no conditioning before it"), expected=f"`{name}` attended at the first step (its prefix or "
            "memory kept for the later ones)", source=f"`{name}` held by {held}", cell=(0, 0, 0))))
    return found


RULES = (
    Rule("conditioning-never-attended", "wrong", "steps", "a conditioned decoder (its forward takes "
         "`encoder_hidden_states` or the like) whose caller holds that conditioning, never handed at any call of the "
         "generation, the first a fresh pass over an empty cache: no step attends it", never_handed),
)
