"""A mask written into a softmax's weights after the softmax, instead of into its scores before it.

trace/after.py follows each recorded softmax's output; a fill of -inf (or at most -1e4) written into it
(`att[~mask] = -inf`, `weights.masked_fill(pad, -inf)`) is recorded on the call as `filled_after`. The program
states there which keys it means to mask; the softmax had already spread the row's weight over them, so the rest
of the row does not sum to 1, and a weighted sum over weights of -inf is -inf or NaN. That contradiction is the
program's own: wrong. A fill of 0 after the softmax (WeNet's rows with no key) is not this (after.py's zeroed_after).

A fill of 0 after the softmax made out of place and never read (`attn.masked_fill(rows, 0.)` on a line of its own)
states which rows the program means to have no weight; the product with the values reads the softmax's own weights,
so those rows still attend (uniform over every key where all are masked with a finite fill, NaN with -inf): the
program's statement and the weights it uses disagree, wrong (zeroing-lost; trace/after.py's `zeroed_unused`).

A 0/1 product after the softmax (a head mask multiplied into the probabilities) that leaves a query row no key at all,
where the softmax's own mask gave it keys, makes that query's output 0: it attends to nothing, its own token
included (Transformers4Rec 3d94628: a causal head_mask built with `torch.tril(..., diagonal=-1)` on GPT-2, whose own
`bias` mask keeps each query's own key). The program's mask before the softmax states the keys the query reads; the
product takes them all (emptied-after-softmax; trace/after.py's `emptied_after`). A query mask multiplied in after
(whole rows 0) that calls a token padding whose key the key mask before the softmax keeps real is the same
contradiction, said as two padding tests that disagree (TiSASRec 1bd63d0: `sign(abs(sum(x)))` calls a real item whose
layer-normalised query sums to 0 padding; its key, from the unnormalised sequence, is kept). Quiet on a padding row (its own
token's key seen by no query after the product) and on a head zeroed whole (a head pruned, as head_mask is meant).
"""

from __future__ import annotations

from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def once_per_site(run, name: str):
    """(call, its details[name]) for the first call of each call site (masked, cross or unmasked) that holds it."""
    done = set()
    for call in [*run.calls, *getattr(run, "cross", ()), *getattr(run, "unmasked", ())]:
        said = call.details.get(name)
        if not said or call.where in done:
            continue
        done.add(call.where)
        yield call, said


def filled_after(run) -> list:
    """(call, Finding) for each call site whose softmax weights the program filled with -inf after the softmax."""
    found = []
    for call, filled in once_per_site(run, "filled_after"):
        rows = filled.get("rows") or []
        value = filled.get("value", "-inf")
        found.append((call, Finding("masked-after-softmax", (
            f"the program writes {value} into {filled.get('cells')} cells of this softmax's output (batch rows "
            f"{rows}) after the softmax: the keys it means to mask already got weight from the softmax, and weights "
            f"of {value} make the weighted sum of the values inf or NaN; fill the scores with {value} before the "
            "softmax"), expected="the mask filled into the scores before the softmax",
            source="a fill written into the softmax's weights")))
    return found


def zeroing_lost(run) -> list:
    """(call, Finding) for each call site whose rows the program zeroed after the softmax in a copy it never read."""
    found = []
    for call, lost in once_per_site(run, "zeroed_unused"):
        b_len, h_len, q_len = call.shape[0], call.shape[1], call.shape[2]
        rows = sorted({int(i) % q_len for i in lost.get("rows") or ()})
        batch = sorted({int(i) // (h_len * q_len) for i in lost.get("rows") or ()}) if b_len > 1 else [0]
        found.append((call, Finding("zeroing-lost", (
            f"the program zeroes the weights of query rows {spans(rows)} (batch rows {spans(batch)}) after the softmax "
            f"with an out-of-place {lost.get('by') or 'masked_fill'} whose result is never used: the product with the "
            f"values reads the softmax's own weights, so those rows still attend ({_what(call)}); assign it "
            "(`attn = attn.masked_fill(...)`) or use masked_fill_"),
            expected="those query rows' weights 0, as the program's masked_fill states",
            source="masked_fill(weights, rows, 0) after the softmax, its result dropped")))
    return found


def emptied_after(run) -> list:
    """(call, Finding) for each call site whose real query rows a 0/1 product after the softmax left with no key."""
    found = []
    for call, emptied in once_per_site(run, "emptied_after"):
        b, h, q = emptied["cell"]
        if _stated_empty(call, b, h, q):
            continue
        found.append((call, Finding("emptied-after-softmax", (
            f"a 0/1 product after the softmax leaves query {q} (batch row {b}, head {h}) no key at all, though the "
            f"softmax's own mask gave it keys {spans(emptied['lost'])} and its own token's key {emptied['own']} is "
            f"seen by other queries: its output is 0 ({emptied['rows']} such rows); {_why(emptied)}"),
            expected="every real query keeps the keys its mask before the softmax gives it (its own included)",
            source="the softmax's own mask (its keys kept before the product)", cell=(b, q, emptied["own"]))))
    return found


def _why(emptied: dict) -> str:
    """The product's kind, in words: a query padding mask calling a real token padding, or a mask dropping keys."""
    if emptied.get("query_mask"):
        return ("the product is a query mask (whole rows 0) that calls this token padding, though the key mask before "
                "the softmax keeps its key as real: the two padding tests disagree (a query mask built from a value "
                "that can be 0 for a real token, sign(abs(sum(x))) where sign(sum(abs(x))) was meant?)")
    return "a mask multiplied into the probabilities that drops the diagonal (tril(diagonal=-1) where tril was meant?)"


def _stated_empty(call, b: int, h: int, q: int) -> bool:
    """Whether a masked_fill of the scores the program made and threw away (checks/discarded.py says it) hides query
    `q`'s row whole: the program's own mask gives it no key, so the product emptying it says what the program means
    (arghosh/AKT 01b7e8d: the fill's result unread, the softmax unmasked, the same mask multiplied in after)."""
    said = call.details.get("fill_discarded")
    hidden = said.get("hidden") if isinstance(said, dict) else None
    if hidden is None or getattr(hidden, "ndim", 0) != 4:
        return False
    return bool(hidden[min(b, hidden.shape[0] - 1), min(h, hidden.shape[1] - 1), q].all())


def _what(call) -> str:
    if call.details.get("fill") == "-inf" and call.details.get("nan_rows"):
        return "NaN where a row's every key is -inf"
    return "a row whose every key is masked spreads its weight over all of them, the keys it masks included"


RULES = (
    Rule("zeroing-lost", "wrong", "call", "rows a program zeroes after the softmax in an out-of-place masked_fill "
         "whose result is dropped, so the weights the values are read with are the softmax's (flamingo-pytorch 10913ab)",
         zeroing_lost),
    Rule("masked-after-softmax", "wrong", "call", "a mask (-inf fill) written into a softmax's weights after the "
         "softmax instead of into its scores before it", filled_after),
    Rule("emptied-after-softmax", "wrong", "call", "a 0/1 product after the softmax (a head mask multiplied into the "
         "probabilities) that leaves a real query no key, where the softmax's own mask gave it keys (Transformers4Rec "
         "3d94628)", emptied_after),
)
