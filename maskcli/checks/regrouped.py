"""A kernel whose positions are no tokens: its queries or keys viewed out of the projection with heads before positions.

The program states which axis holds its tokens where it projects them: a (B, L, E) output (nn.Linear's, E = H·D), L
tokens a sample, E features each. A kernel's mask (causal, padding, a window) orders the positions of its last axes;
they are the tokens only where the (B, H, L, D) the kernel is handed steps one token of that output per position (a
view to (B, L, H, D), then a transpose). A view straight to (B, H, L, D) (Informer2020 7f8b80c: `.view(B, H, L, -1)`
of a (B, L, H, D) tensor where `.transpose(2, 1)` was meant) steps D features per position: positions 0 and 1 of a
plane are the two halves of token 0, and each plane holds L / H tokens, each cut into H positions. Whatever mask the
kernel ran with, it is laid on head slices of some tokens, never on the L tokens the program projected: its causal
mask hides half of a token from the other, and no query sees a token of another plane. trace/regrouped.py reads it
off the strides of the tensor the kernel was handed against the output it is a view of: wrong.

Quiet where the kernel's positions step whole tokens of that output (the transpose: any layout, fused qkv, a
sequence-first buffer) and where its positions are not a sample's tokens (an axis of features split into tokens: a
tabular model's per-feature tokens). The heads folded into the batch alike: a (B·H, L, D) view straight of (B, L, E)
(FuxiCTR#30: AutoInt's `view(batch_size * num_heads, -1, attention_dim)`), each plane 1/H of a sample and more than
one token. Not seen: a view copied before the kernel (its strides say nothing then), a fold whose planes are one token
or less (the same view as each token's heads laid as positions), and the same regrouping after the kernel
(`out.view(B, L, -1)` of a (B, H, L, D) context: Informer's later fix), which changes no mask. A copying reshape
(tgm#168's TGAT: `K.reshape(B, n_heads, -1, head_dim)` of a slice of its fused KV projection) is read from the
reshape's note or the copy's autograd node (trace/regrouped.py), the einsum "bhld,bhnd->bhln" like q @ kᵀ.

heads-as-positions: the transpose missing altogether, q/k/v handed (B, L, H, D) where the kernel reads (B, H, L, D)
(Stylish-TTS b97a5b6: the conformer's `b n h d` into SDPA). The kernel's head axis then steps one token and counts a
sample's L tokens, its positions step D features, the H heads of one token: each token attends over its own heads.
trace/regrouped.py's `swapped` reads it off the strides; wrong only where the attention's own module (the innermost
running one) states a head count equal to those positions: a frame's sub-bands handed to SDPA as positions on purpose
state none, or another.
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _per_site(run: Run, field: str, make) -> list:
    """(call, finding) for every call whose details hold `field`, the finding made by `make(call, facts)` (None: none
    at that call) once per call site and shape."""
    found, done = [], {}
    for call in [*run.calls, *run.cross, *run.unmasked]:
        facts = call.details.get(field)
        if not facts:
            continue
        key = (call.where, call.shape)
        if done.get(key) is None:
            done[key] = make(call, facts)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def regrouped(run: Run) -> list:
    """Calls whose queries or keys step inside one token of the projection they are a view of."""
    return _per_site(run, "regrouped", _finding)


def _finding(call, facts: dict) -> Finding:
    side = "keys" if "key" in facts else "queries"
    fact = facts["key" if "key" in facts else "query"]
    tokens, row, step = fact["tokens"], fact["row"], fact["step"]
    (t0, f0), (t1, f1) = fact["held"][:2]
    per = max(1, tokens * step // row)
    masked = "its mask over them" if call.stored is not None else "its attention"
    how, op = ("a reshape (a copy)", "`.reshape`") if fact.get("copied") else ("a view", "`.view`")
    return Finding("positions-regrouped", (
        f"the kernel's {side} are {how} of a ({tokens}, {row}) projection whose rows are the tokens, stepping {step} "
        f"features a position: position 0 is token {t0} (features {f0}-{f0 + step - 1}) and position 1 token {t1} "
        f"(features {f1}-{f1 + step - 1}), so each plane holds {per} of the {tokens} tokens cut into head slices and "
        f"{masked} orders those slices, not the tokens (a {op} laid heads before positions where a transpose was "
        f"meant)"),
        expected=f"each of the {tokens} positions one token of the projection", source="the projection the "
        f"{side} are a view of")


def on_heads(run: Run) -> list:
    """Calls whose queries or keys are laid (B, L, H, D): positions the H heads the module states, heads its tokens."""
    return _per_site(run, "heads_swapped", _stated_heads)


def _stated_heads(call, facts: dict) -> Finding | None:
    """heads-as-positions' finding, only where the module's own head count is what the kernel took for positions."""
    side = "key" if "key" in facts else "query"
    fact, stated = facts[side], facts.get("stated")
    if stated is None or stated != fact["heads"] or stated == fact["tokens"]:
        return None
    return _on_heads(call, "keys" if side == "key" else "queries", fact, stated)


def _on_heads(call, side: str, fact: dict, stated: int) -> Finding:
    tokens, heads, step = fact["tokens"], fact["heads"], fact["step"]
    (t0, f0), (t1, f1) = fact["held"][:2]
    return Finding("heads-as-positions", (
        f"the kernel's {side} are a ({tokens}, {heads}, {step}) view of a projection whose {tokens} rows are the "
        f"tokens: its head axis steps one token and its {heads} positions step {step} features, the {heads} heads of "
        f"one token (the module states {stated} heads): position 0 is token {t0} (features {f0}-{f0 + step - 1}) and "
        f"position 1 token {t1} (features {f1}-{f1 + step - 1}), so each token attends over its own {heads} head slices, not "
        f"over the {tokens} tokens, and any mask it ran with orders heads (q/k/v handed (B, L, H, D) where the kernel reads "
        f"(B, H, L, D): a transpose missing)"),
        expected=f"{stated} heads, each over the {tokens} tokens", source=f"the module's head count ({stated}) and the "
        f"projection the {side} are a view of")


RULES = (
    Rule("positions-regrouped", "wrong", "call", "queries or keys viewed out of their (B, L, H·D) projection with heads "
         "before positions (`.view(B, H, L, D)` where a transpose was meant): the kernel's mask orders head slices of "
         "tokens, not the tokens (Informer2020 7f8b80c)", regrouped),
    Rule("heads-as-positions", "wrong", "call", "queries or keys laid (B, L, H, D) where the kernel reads "
         "(B, H, L, D): its positions are the heads the module states, its heads the tokens (Stylish-TTS b97a5b6)",
         on_heads),
)
