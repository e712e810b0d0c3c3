"""A query of a self-attention that sees no key at all though its token is real: the mask hides every key from a token
whose output the program uses (rows.py's fully-masked, *wrong* there; rows of padding that see nothing are routine).

A token is real where the program says so in either of two ways:
- another query of its row sees it as a key, its keys being its queries' own projection (LLMs-from-scratch#1061's
  future mask handed to SDPA as a keep-mask: the last token sees nothing);
- the padding mask the program holds at the call (trace/held.py: `mask`, `attention_mask` 1 = real; `*pad_mask`
  True = padding) calls it real, over as many keys as queries in a self-attention, and the call's mask keeps to that
  padding (no query of the row sees a key it calls padding: the padding read the way the program applies it, not a
  loss mask or one of the other polarity). pi-zero-pytorch 346bb05: the flex mask_fn AND-ed `key >= prefix_length`
  into the padded causal mask, so every image and language token of the prefix saw no key.

A cross-attention whose mask hides a batch row's whole context (every query of the row sees no key, other rows see
some) from a softmax with a finite fill gives that row's queries, the decoder's own tokens, uniform weights over the
context the program masks: its padding is read (x-transformers#263: a sample with no conditioning spread its
attention over the padded context; the fix zeroes those rows' output, trace/after.py's `zeroed_output`). Wrong there;
quiet where the kernel or the program gives those rows 0 (SDPA, flash, flex, a fill of 0 after), on a batch row the
batch's own `attention_mask` calls padding throughout (a sample of padding alone: Pop2Piano's separator rows), and on
padding queries, which a cross-attention's key mask never hides whole: a batch row that is a chunk of padding alone, of a
sequence the program's own padding mask covers folded into the batch in chunks of the keys (checks/heldfold.py: an
hourglass transformer's pooled bucket attending to its bucket), is such a padding query.
"""

from __future__ import annotations

import numpy as np

from maskcli import tracefile
from maskcli.checks.context import cross
from maskcli.checks.heldfold import folded_padding
from maskcli.checks.tiled import batch_part
from maskcli.text import Finding


def real_but_empty(call, stored: dict, empty: np.ndarray) -> tuple[int, int, str] | None:
    """(batch row, query, why its token is real) for the first such query; None where there is none. `empty`: bool
    (b, Lq) rows that see no key in some head."""
    if call.shape[2] != call.shape[3] or stored["form"] == "stats":
        return None
    cells = tracefile.dense(stored)  # (b, h, Lq, Lk)
    if cells.shape[2] != cells.shape[3] or cells.shape[0] != empty.shape[0]:
        return None
    seen = cells.any(axis=1)  # (b, Lq, Lk) over the heads
    if call.details.get("kv_source") == "query":
        hit = empty & seen.any(axis=1)  # (b, Lk): a key another query sees
        if hit.any():
            b, q = (int(i) for i in np.argwhere(hit)[0])
            k = int(np.flatnonzero(seen[b, :, q])[0])
            return b, q, (f"its token is a real key that query {k} sees, in a self-attention whose keys are its "
                          "queries' own projection")
    helds = call.details.get("held_padding") or ()
    if not helds or cross(call) or batch_part(call):
        return None  # (a call over a chunk of the batch: the padding held for the batch is not its rows', tiled.py)
    for held in helds:
        rows = held.get("rows")
        if held.get("kind") not in ("keep", "pad") or not isinstance(rows, np.ndarray) or rows.dtype != bool \
                or rows.ndim != 2 or rows.shape[1] != cells.shape[3] or cells.shape[0] not in (1, rows.shape[0]) \
                or call.shape[0] != rows.shape[0]:
            continue  # (a mask stored once for the batch, every row's the same: read against each row's padding; a
            # call over fewer rows than the padding held, a pipeline's micro-batch, is not over those rows)
        real = rows if held["kind"] == "keep" else ~rows
        sees = np.broadcast_to(seen, (rows.shape[0], *seen.shape[1:]))
        nothing = ~np.broadcast_to(cells.any(axis=3).any(axis=1), rows.shape)  # (b, Lq): no key in any head
        if real.all() or not real.any(axis=1).all() or (sees & ~real[:, None, :]).any():
            continue  # (no padding, a row with no real token, or a mask that does not keep to this padding)
        hit = nothing & real
        if hit.any():
            b, q = (int(i) for i in np.argwhere(hit)[0])
            return b, q, (f"its token is real by the program's own padding mask {held['name']} in {held['where']}, "
                          "which the mask keeps to (no query sees a key it calls padding), in a self-attention of as "
                          "many queries as keys")
    return None


def context_masked_whole(call, stored: dict, empty: np.ndarray, effect: str) -> Finding | None:
    """fully-masked, wrong, for a cross-attention batch row whose every query sees no key and takes uniform weights over
    the masked context (`effect`: rows.py's what_api_does); None elsewhere. `empty`: bool (b, Lq) rows that see no key."""
    if not cross(call) or not effect.startswith("uniform weights") or empty.shape[0] < 2 or stored["form"] == "stats":
        return None
    whole = empty.all(axis=1)  # (b,): batch rows whose every query sees nothing
    cells = tracefile.dense(stored)
    if not whole.any() or whole.all() or not cells.any(axis=(1, 2, 3))[~whole].all():
        return None
    for _, real in folded_padding(call, call.details.get("held_padding")):
        whole = whole & real.any(axis=1)  # (a chunk of padding only, of a sequence folded into the batch: its query is
    whole &= ~padding_samples(call)  # the chunk's own, padding too: hourglass-transformer-pytorch 674ede1's fix)
    if not whole.any():
        return None
    b = int(np.flatnonzero(whole)[0])
    return Finding("fully-masked", (
        f"every query of batch row {b} sees no key of its context at all in this cross-attention ({call.shape[3]} keys, "
        f"each masked by the program), where the other batch rows see theirs: {effect}, so the row's real queries read "
        "the context the program masked as padding (zero those rows' output, or give them a key)"), "wrong",
        expected="no weight on keys the mask hides: 0 output for a row with no key", cell=(b, 0, 0))


def padding_samples(call) -> np.ndarray:
    """Bool (b,): batch rows the batch's own `attention_mask` (held by the program where the call ran: its name, or a
    batch's `["attention_mask"]`) marks 0 throughout: samples of padding alone, no input of their own, whose outputs a
    program drops (Pop2Piano's feature extractor puts an all-zero row after each clip: written blind, quiet-r132b). A
    sample with input but no context (x-transformers#263's, masked by a `context_mask`) is no such row."""
    rows = np.zeros(call.shape[0], bool)
    for held in call.details.get("held_padding") or ():
        given = held.get("rows")
        name = str(held.get("name", ""))
        if held.get("kind") == "keep" and (name == "attention_mask" or name.endswith('["attention_mask"]')) \
                and isinstance(given, np.ndarray) and given.ndim == 2 and given.shape[0] == call.shape[0] \
                and given.any(axis=1).any():
            rows |= ~given.any(axis=1).astype(bool)
    return rows
