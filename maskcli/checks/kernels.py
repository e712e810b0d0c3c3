"""The kernels' own rules: is_causal aligned top-left, a hint a kernel reads its own way or never reads, what HF asked
that the attention function dropped, a keep mask added to the scores.

hint_ignored and ones_added read the calls of a trace (a run); the others read one group of the trace's report
(its first call, stored mask and name) or, top-left causal, a tensor a user gave (inspect).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep, queries
from maskcli.checks.registry import Rule
from maskcli.checks.rows import reach
from maskcli.text import Finding


FAST = "on its fast path (eval, no grad) it never reads it:"
SLOW = "with a key padding mask or need_weights"


def hint_ignored(run: Run) -> list:
    """is_causal=True said to a kernel that applied a mask letting queries see later keys (MHA reads is_causal as a
    hint about attn_mask and applies attn_mask itself wherever it needs a mask: a key padding mask, need_weights;
    torch/nn/functional.py multi_head_attention_forward)."""
    found, done = [], set()
    for call in run.calls:
        if call.api != "mha" or not call.details.get("is_causal") or call.mask in done or "ignored_is_causal" in call.details:
            continue  # (the fast path's ignored-is-causal says it applied no mask at all)
        done.add(call.mask)
        cells = keep(call)
        if cells is None:
            continue
        top = run.top(call)
        own = queries(call, top)
        later = cells & (np.arange(call.shape[3])[None, :] > own[:, None])
        if later.any():
            b, h, q, k = first_cell(later)
            found.append((call, Finding(
                "hint-ignored", f"is_causal=True is only a hint to nn.MultiheadAttention: "
                f"{FAST if call.details.get('path') == 'fast' else SLOW} it applies attn_mask, and attn_mask lets "
                f"query {int(own[q])} see later key {k}",
                expected="causal", source="is_causal=True", cell=(b, int(own[q]), k))))
    return found


def mask_dropped(run: Run) -> list:
    """An attn_mask nn.MultiheadAttention's slow path dropped: with is_causal=True, no key_padding_mask and
    need_weights=False, F.multi_head_attention_forward hands SDPA is_causal in place of attn_mask (torch/nn/functional.py:
    "attn_mask = None"), a training-mode TransformerEncoderLayer's self-attention included. Said where the mask passed
    is not that causal mask (trace/masks.py's _dropped): the kernel ran causal, the program passed another mask."""
    found, done = [], set()
    for call in run.calls:
        dropped = call.details.get("dropped_attn_mask")
        if call.api != "mha" or not isinstance(dropped, dict) or (call.mask, repr(dropped)) in done:
            continue
        done.add((call.mask, repr(dropped)))
        b, h, q, k = dropped["cell"]
        passed = f"the attn_mask passed ({dropped['name']})" if dropped.get("name") else "the attn_mask passed"
        cell = (f"query {q} sees key {k}, which the mask passed masks" if not dropped["keeps"] else
                f"query {q} does not see key {k}, which the mask passed lets it see")
        found.append((call, Finding("mask-dropped", (
            f"{passed} was dropped: with is_causal=True, no key_padding_mask and need_weights=False, "
            f"nn.MultiheadAttention's slow path hands SDPA is_causal in its place, so the kernel ran causal: {cell} "
            f"(is_causal=True is a hint that attn_mask is causal; pass is_causal=False to apply the mask)"),
            expected=dropped.get("name") or "the attn_mask passed", source="attn_mask with is_causal=True",
            cell=(b, q, k))))
    return found


def ones_added(run: Run) -> list:
    """A float attn_mask of 0s and 1s: a keep mask (True = attend) cast to float and added to the scores, which masks
    nothing (SDPA adds a float mask: torch/nn/functional.py scaled_dot_product_attention's docstring; so does
    nn.MultiheadAttention, its attn_mask and its key_padding_mask alike: multi_head_attention_forward's docstring)."""
    found, done = [], set()
    for call in [*run.calls, *run.cross, *run.unmasked]:  # (a 0/1 mask that masks nothing leaves its site unmasked;
        # a cross-attention adds it alike: parseq's ABINet memory_mask, an eye of 0s with 1s where -inf was meant)
        if not call.details.get("zero_one") or call.mask in done:
            continue
        done.add(call.mask)
        if call.api == "softmax":  # (the program's own sum, scores + mask: trace/scores.py)
            found.append((call, Finding(
                "ones-added", "the float mask added to these scores before the softmax holds only 0 and 1: a keep (or "
                "pad) mask cast to float and added as it is shifts a key's score by 1 at most, so it masks nothing "
                "(add (1 - mask) * finfo.min, or masked_fill the scores)", expected="an additive mask: 0 and -inf",
                source="a 0/1 float tensor added to the scores")))
            continue
        name = call.details["zero_one"] if isinstance(call.details["zero_one"], str) else "attn_mask"
        dtype = call.details.get("mask_dtype") or call.details.get(f"{name}_dtype")
        found.append((call, Finding(
            "ones-added", f"the float {name} holds only 0 and 1: a keep (or hide) mask cast to float is added to the "
            "scores, so it masks nothing (pass it as bool in the kernel's polarity, or put -inf or finfo.min where it "
            "hides)",
            expected="an additive mask: 0 and -inf", source=f"{call.api}'s {name}, {dtype}")))
    return found


def top_left_is_causal(call, q_len: int, k_len: int) -> bool:
    """An SDPA call whose mask is its is_causal alone, with fewer queries than keys: aligned top-left (torch.tril)."""
    return bool(call.details.get("is_causal")) and call.api == "sdpa" and q_len < k_len and "mask_dtype" not in call.details


def top_left(call, q_len: int, k_len: int) -> list[Finding]:
    """A trace group's is_causal with fewer queries than keys: its queries see the first keys, not the cached ones."""
    if not top_left_is_causal(call, q_len, k_len):
        return []
    sees = ("its one query sees key 0 only, so the last {} keys are seen by no query" if q_len == 1 else
            "query row i sees keys 0..i, so the last {} keys are seen by no query until the last rows").format(k_len - q_len)
    return [Finding("top-left-causal", (
        f"is_causal with {q_len} quer{'y' if q_len == 1 else 'ies'} and {k_len} keys is aligned top-left: {sees}; "
        f"a decoder with a cache means bottom-right (causal --offset {k_len - q_len}): pass that mask instead of is_causal"))]


def given_top_left(structure, as_sdpa: np.ndarray) -> list[Finding]:
    """A tensor a user gave (inspect) that is causal aligned top-left as SDPA reads it (`as_sdpa`: its keep cells in
    SDPA's (B, H, Lq, Lk) view, whatever reading the recogniser chose)."""
    q_len, k_len = as_sdpa.shape[-2:]
    placed_top_left = structure.kind == "causal" and structure.mask is not None and structure.mask.q_offset == 0
    if not (structure.kind is None or structure.reading == "key padding [B, S]" or placed_top_left) or not 1 < q_len < k_len:
        return []
    if not np.array_equal(as_sdpa, np.broadcast_to(np.tri(q_len, k_len, dtype=bool), as_sdpa.shape)):
        return []
    return [Finding(
        "top-left-causal",
        ("read as an (Lq, Lk) mask instead, it is " if structure.reading == "key padding [B, S]" else "")
        + f"causal aligned top-left (query row q sees keys 0..q, torch.tril of a {q_len}x{k_len} matrix, "
        f"causal_upper_left, SDPA's is_causal=True): with {k_len - q_len} cached keys the new queries usually "
        f"sit at the end; bottom-right is maskcli show causal --offset {k_len - q_len} --len {q_len}",
    )]


def tensor_top_left(a, _heads=None) -> list[Finding]:
    """A tensor a user gave (inspect's Analysis, taken as it comes): causal aligned top-left as SDPA reads it."""
    return given_top_left(a.structure, a.as_sdpa)


def ignored_is_causal(call, k_len: int) -> list[Finding]:
    """is_causal=True on a module's fast path, which never reads it (trace/modules.py: it applied no mask)."""
    if not call.details.get("ignored_is_causal"):
        return []
    return [Finding("ignored-is-causal", (
        f"is_causal=True was ignored: the module's fast path (eval, no grad) never reads it; "
        f"{call.details['ignored_is_causal']}"), expected="causal", source="is_causal=True",
        cell=(0, 0, 1) if k_len > 1 else None)]  # query 0 sees key 1, as every query sees every key


def asked(call, stored: dict, name: str) -> list[Finding]:
    """What HF asked of a kernel call it gave no mask (is_causal, sliding_window) that the kernel did not apply: an
    attention function that drops them (a registered one of the user's) attends where the model must not.
    The queries placed at the end of the keys: the latest they can sit, so a later key is one for any placement."""
    hf = call.details.get("hf")
    if call.api == "hf" or not isinstance(hf, dict) or "error" in hf or hf.get("attention_mask") is not None:
        return []  # (a mask given is HF's word on the cells; the interface's own record is what its arguments mean)
    eager = hf.get("attn_implementation") == "eager"  # (the model's own eager_attention_forward, which reads no
    # is_causal: a model that wants a causal eager call hands the mask; with none, it attends every key by design.
    # BridgeTower's cross-modal image layers: is_causal=True on a module that is handed no mask)
    if call.details.get("hf_part"):
        return []  # (one block of the queries or keys HF handed the function, a ring's step: where its queries and
        # keys sit is the function's own split, which the block alone does not say: trace/capture.py)
    q_len, k_len = call.shape[2:]
    first, last = reach(stored, q_len)
    found = []
    causal = hf.get("is_causal", hf.get("module_is_causal"))
    if causal and not eager and (last > k_len - q_len + np.arange(q_len)[None, :]).any():
        said = "is_causal=True" if "is_causal" in hf else "its module's is_causal is True"
        found.append(Finding("hf-not-causal", f"HF asked for a causal mask ({said}) but the kernel applied {name}: "
                                              "queries see later keys"))
    window = hf.get("sliding_window")
    if isinstance(window, int) and window > 0 and not eager and ((last >= 0) & (last - first >= window)).any():
        found.append(Finding("hf-not-windowed", f"HF asked for sliding_window={window} but the kernel applied {name}: "
                                                f"queries see keys {window} or more positions apart, outside the window"))
    return found


def refused(calls: list) -> list[Finding]:
    """The calls of a group whose kernel raised (torch refused is_causal=2, shapes that do not match): each was
    recorded as it was called, but no attention ran with its mask."""
    raised = [call for call in calls if "raised" in call.details]
    if not raised:
        return []
    which = "every call" if len(raised) == len(calls) else f"call{'s' if len(raised) > 1 else ''} {', '.join(str(c.index) for c in raised[:8])}"
    return [Finding("call-raised", f"{which} of this group raised {raised[0].details['raised'].rstrip('.')}: "
                    f"{'they' if len(raised) > 1 else 'it'} did not complete, so no attention ran with this mask there "
                    "(the program saw the error)", severity="note")]


def group_kernel(g) -> list[Finding]:
    """What the kernel made of a trace group's arguments (checks/grouped.py): what HF asked and it did not apply, calls
    it refused, is_causal a module's fast path ignored, is_causal aligned top-left."""
    first = g.first
    return asked(first, g.stored, g.name) + refused(g.calls) + ignored_is_causal(first, g.k_len) + top_left(first, g.q_len, g.k_len)


RULES = (
    Rule("call-raised", "note", "call", "a call whose kernel raised (torch refused its arguments): no attention ran with "
         "its mask", group_kernel, "kernel"),
    Rule("top-left-causal", "wrong", "call", "is_causal with fewer queries than keys: SDPA aligns it top-left, so a "
         "decode step behind a cache sees key 0 only", group_kernel, "kernel", also=(("tensor", tensor_top_left),)),
    Rule("hf-not-causal", "wrong", "call", "Hugging Face asked for a causal mask that the attention function did not "
         "apply", group_kernel, "kernel"),
    Rule("hf-not-windowed", "wrong", "call", "Hugging Face asked for a sliding window that the attention function did "
         "not apply", group_kernel, "kernel"),
    Rule("ignored-is-causal", "wrong", "call", "is_causal=True on nn.MultiheadAttention's or an encoder layer's fast "
         "path, which never reads it: no mask, or a mask that lets queries see later keys, applied", group_kernel, "kernel"),
    Rule("hint-ignored", "wrong", "call", "is_causal=True beside a mask that lets queries see later keys: the kernel "
         "applied the mask", hint_ignored),
    Rule("mask-dropped", "wrong", "call", "is_causal=True on nn.MultiheadAttention's slow path (no key padding mask, "
         "no weights): the attn_mask passed, not causal, was dropped for SDPA's causal mask", mask_dropped),
    Rule("ones-added", "wrong", "call", "a keep mask of 0s and 1s added to the scores as a float mask: nothing is "
         "masked", ones_added),
)
