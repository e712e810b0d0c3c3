"""A cross-attention masked as a causal self-attention: decoder query i sees only encoder keys 0..i.

A call the program itself says is a cross-attention (a running module's `attention_type="cross"`,
`is_cross_attention=True`: checks/context.crossing's "said") attends from the decoder's tokens to the encoder's memory: key j
is encoder token j, not a later position of the query's own sequence, so a triangle that hides key j from every query
before j hides real memory for no reason (TransformerEngine#565: the inter-attention called with the self-attention's
`attn_mask_type="causal"`, its `enc_dec_attn_mask` dropped). Said where the mask is exactly the triangle's shape, per
batch row with the memory's padding (columns no query of the row sees) set aside: no query sees a key after its own
index, and every query sees its own real one (a padding mask on top of a triangle is still the triangle's bug). With
fewer queries than keys the triangle may be aligned bottom-right, as flash-attention / Transformer Engine place a
causal window type `(-1, 0)`: query i sees keys 0..i + Lk - Lq (TransformerEngine#629: the self-attention's window
handed to the inter-attention beside its padding mask). A wait-k policy the program states makes the triangle of
offset k - 1 meant. A cross-attention told apart by its module path alone (context.CROSS_WORDS)
is not read here: the module's own word is, and so is the attending module's class name where nothing the call was
handed says otherwise (trace/crossing.py's "class": transformers#48172, `MllamaTextCrossAttention` run `is_causal=True`
under SDPA, its 10 vision tokens cut to the text's 6 keys).

A program may state that its cross-attention reads the memory as it arrives: a wait-k policy (simultaneous
translation, STACL / fairseq's `waitk`: target step t reads source tokens 0 .. t + k - 1), stated as a config field or
a model call's argument `waitk` / `wait_k`. With k = 1 that policy is the triangle, meant; with another k the
triangle contradicts it (the message says so).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, crossing, keep
from maskcli.checks.intent import intent
from maskcli.checks.registry import Rule
from maskcli.checks.causalname import named as causal_named
from maskcli.text import Finding


POLICY = ("waitk", "wait_k")


def wait_k(run: Run, call) -> tuple[int, str] | None:
    """(k, where it is said) of a wait-k policy the program states for `call`: its model call's argument, else a config."""
    top = run.top(call)
    for name in POLICY:
        given = None if top is None else top.arguments.get(name)
        if given is not None and np.ndim(given) == 0 and int(given) >= 1:
            return int(given), f"{name}={int(given)} given to {top.where}"
    stated = intent(run, call)
    for name in POLICY:
        value = stated.values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value, f"{name}={value} ({stated.sources.get(name)})"
    return None


def _triangle(cells: np.ndarray, q_len: int, k_len: int) -> tuple[int, int] | None:
    """(offset, cells hidden) where the (b, h, Lq, Lk) mask is a causal triangle over the keys: query i sees no key past
    i + offset and sees key i + offset unless no query of its row sees that key (padding of the memory), with some real
    key hidden past the diagonal; offset 0 (top-left) or Lk - Lq (bottom-right, the kernel's convention for a window or
    causal type over fewer queries than keys: TransformerEngine#629). None where neither is."""
    padding = ~cells.any(axis=-2, keepdims=True)  # columns no query of the batch row and head sees
    rows, columns = np.arange(q_len)[:, None], np.arange(k_len)[None, :]
    for offset in sorted({0, max(k_len - q_len, 0)}):
        later, diagonal = columns > rows + offset, columns == rows + offset
        if cells[..., later].any() or not (cells | padding)[..., diagonal].all():
            continue
        hidden = int((~cells & ~padding)[..., later].sum())
        if hidden:
            return offset, hidden
    return None


def causal_cross(run: Run) -> list:
    """Calls a module states are cross-attention whose mask is a causal triangle over the memory."""
    found, done = [], {}
    for call in run.cross:
        reading = crossing(call)
        named = call.details.get("cross") if isinstance(call.details.get("cross"), dict) else {}
        named = named.get("source") if named.get("by") == "class" else None  # (trace's reading, before the path's)
        said = reading.source if reading.by == "said" else named if named and not causal_named(named) else None
        # (the module's own word or its class's name, `MllamaTextCrossAttention`: not its path, nor a shape; a class
        # named causal too, Perceiver AR's `CausalCrossAttention`, states the triangle)
        q_len, k_len = call.shape[2:]
        if not said or q_len < 2:
            continue
        key = (call.mask, call.shape)
        if key not in done:
            done[key] = None
            cells = keep(call)
            if cells is None:
                continue
            triangle = _triangle(cells, q_len, k_len)
            if triangle is None:
                continue
            offset, hidden = triangle
            policy = wait_k(run, call)
            if policy is not None and policy[0] == offset + 1:
                continue  # (wait-k: target step t reads source tokens 0..t + k - 1, the triangle the program states)
            why = "the self-attention's causal mask type handed to the cross-attention?" if policy is None else (
                f"the program's wait-k policy says query i reads keys 0..i + {policy[0] - 1} ({policy[1]}): a "
                f"wait-{offset + 1} mask, or the self-attention's causal mask handed to the cross-attention?")
            sees = "keys 0..i" if offset == 0 else f"keys 0..i + {offset} (the triangle aligned bottom-right)"
            done[key] = Finding("cross-attention-causal", (
                f"the program says this call is a cross-attention ({said}), yet its mask is a causal triangle over "
                f"the memory: query 0 sees only {'key 0' if offset == 0 else f'keys 0..{offset}'}, query i only {sees} ({hidden} cells of later "
                f"memory hidden): {why}"),
                expected="no causal triangle over the encoder's memory" if policy is None else
                f"query i reads keys 0..i + {policy[0] - 1} (wait-{policy[0]})",
                source=said if policy is None else f"{said}; {policy[1]}", cell=(0, 0, offset + 1))
        if done[key] is not None:
            found.append((call, done[key]))
    return found


RULES = (
    Rule("cross-attention-causal", "wrong", "call", "a call a module states is a cross-attention (attention_type="
         "'cross', is_cross_attention=True) whose mask is a causal triangle over the encoder's memory", causal_cross),
)
