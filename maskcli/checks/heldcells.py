"""A mask over the call's cells that the program holds at an attention call, against the mask the kernel applied.

A frame on the stack when attention runs may hold a mask over the call's cells (trace/held.py: a streaming encoder's
`chunk_mask`, a bool (B, 1, Lq, Lk) mask handed down as `attention_mask` / `attn_mask` / `mask`), which the kernel's
mask must keep inside, read either way round as its name does not say its polarity (held-mask-ignored: espnet#4751's
AND, Megatron-LM#7039's window that replaced it; a 2-D (Lq, Lk) `mask` handed down that cannot be the batch's padding,
infini-transformer#4's causal triangle the layer took and never passed on). A padded batch's mask held while the kernel is called one request at
a time (batch 1, n x n) must keep each call inside the block of a request with n real tokens (TGI's Gemma 3 handing a
padded (B, 1, L, L) mask to a kernel that reads one packed block a request). The padding a frame holds (a padding mask,
lengths) is checks/held.py's.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def held_cells(run: Run) -> list:
    """Calls whose queries see cells that a mask the program holds there (a chunk mask; a bool (B, 1, Lq, Lk) mask handed
    down as attention_mask / attn_mask / mask) hides, whichever way round it is read."""
    found, done = [], {}
    square = [call for call in run.unmasked if call.api in ("softmax", "sdpa") and call.shape[2] == call.shape[3] > 1]
    for call in [*run.calls, *square]:  # (a square softmax whose site masks nowhere: the mask handed down, never used)
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        helds = [held for held in call.details.get("held_padding") or () if held["kind"] == "cells"
                 and not any(call is one for one in square)] + _square(call.details.get("held_padding"), rows, q_len, k_len)
        if not helds or call.stored is None or q_len < 2:
            continue
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = _cells_finding(call, helds, rows, q_len, k_len)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _square(helds, rows: int, q_len: int, k_len: int) -> list[dict]:
    """Held 2-D bool masks handed down as `mask` / `attention_mask` (read as a padding mask, 1 = real: trace/held.py)
    that are (Lq, Lk) over a square call's cells and cannot be its batch's padding (as many rows as its queries, which
    are not its batch rows nor divide them: a (L, L) causal triangle built once for every batch row and handed down,
    dingo-actual/infini-transformer#4's `mask` the layer was given and never passed on), as cells (1, Lq, Lk)."""
    found = []
    for held in helds or ():
        table = held.get("rows")
        if held.get("kind") == "keep" and held.get("name") in ("mask", "attention_mask") and q_len == k_len > 1 \
                and isinstance(table, np.ndarray) and table.shape == (q_len, k_len) and q_len != rows \
                and rows % q_len:
            found.append({**held, "kind": "cells", "rows": table[None], "square": True})
    return found


def _padding_queries(table: np.ndarray) -> np.ndarray:
    """Bool (rows, Lq): the queries whose own cell the held mask treats unlike most queries' own (hidden where the rest
    are kept, or the other way round, whichever its polarity): its padding queries (a trainer's causal & padding mask),
    whose rows the kernel may fill as it likes (MaxText's segment ids let padding see padding)."""
    rows, q_len, k_len = table.shape
    if q_len != k_len:
        return np.zeros((rows, q_len), dtype=bool)
    own = table[:, np.arange(q_len), np.arange(q_len)]
    usual = own.mean() >= 0.5
    return own != usual if (own == usual).mean() > 0.5 else np.zeros((rows, q_len), dtype=bool)


def _cells_finding(call, helds, rows: int, q_len: int, k_len: int) -> Finding | None:
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    cells = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
    counted = ~cells.all(axis=2) | ~cells.all(axis=(1, 2), keepdims=False)[:, None]  # (rows every key unmasked: NaN-proof)
    counted = counted & ~_discarded(cells, helds, rows, q_len, k_len)
    for held in helds:
        table = held["rows"]
        if rows == 1 and table.ndim == 3 and table.shape[0] > 1:
            found = _request_finding(call, held, cells[0], counted[0])
            if found is not None:
                return found
            continue
        table = _laid(table, rows, q_len, k_len)
        if table is None or table.all() or not table.any():
            continue
        if held.get("square") and cells.all():  # (a call that masks nothing unmasks no padding row on purpose: the
            counted = np.ones_like(counted)  # (Lq, Lk) mask dropped; _square's come last, after the cells masks)
        counted = counted & ~_padding_queries(table)
        either = [cells & ~table & (counted & table.any(axis=2))[:, :, None],  # (True = keep; True = hide; a row it
                  cells & table & (counted & ~table.all(axis=2))[:, :, None]]  # hides whole is padding the kernel fills)
        if all(bad.any() for bad in either):
            bad = min(either, key=lambda x: int(x.sum()))
            b, q, k = first_cell(bad)
            said = f"{held['name']} in {held['where']}"
            return Finding("held-mask-ignored", (
                f"batch row {b}: query {q} sees key {k}, which {said} hides whichever way round it is read "
                f"(True = keep or True = masked; {int(bad.sum())} such cells at least): the mask the program holds for "
                f"this call does not bound what the kernel lets each query see (combined the wrong way, or dropped?)"),
                expected=f"within {held['name']}", source=said, cell=(b, q, k))
    return None


def given_up(call, cells: np.ndarray) -> np.ndarray | None:
    """Bool (B, Lq) of `_discarded` for a call's kept cells (B or 1, H, Lq, Lk), from the cells masks its frames hold;
    None where none is held."""
    helds = [held for held in call.details.get("held_padding") or () if held["kind"] == "cells"]
    if not helds:
        return None
    rows, _, q_len, k_len = cells.shape
    return _discarded(cells.any(axis=1), helds, rows, q_len, k_len)


def _discarded(cells: np.ndarray, helds, rows: int, q_len: int, k_len: int) -> np.ndarray:
    """Bool (rows, Lq): the queries a held mask the kernel keeps to (in one reading) hides from every key: rows the
    program itself gave up for this call (CodeGeeX sets every query past the context to masked, and reads only the
    context's last row's output), which an additive mask shifts as a whole, so that they attend everywhere; no other
    mask the program holds (the one it refined, in a frame further out) is asked of them."""
    gone = np.zeros((rows, q_len), dtype=bool)
    for held in helds:
        table = _laid(held["rows"], rows, q_len, k_len)
        if table is None:
            continue
        for hides in (table, ~table):  # (True = masked; True = keep)
            whole = hides.all(axis=2)
            if whole.any() and not whole.all() and not (cells & hides & ~whole[:, :, None]).any():
                gone |= whole
    return gone


def _laid(table: np.ndarray, rows: int, q_len: int, k_len: int) -> np.ndarray | None:
    """A held cells table, (Lq, Lk) or (1 or rows, Lq, Lk), broadcast over the call's (rows, Lq, Lk); None where it is
    not over the call's cells."""
    if table.ndim not in (2, 3) or table.shape[-2:] != (q_len, k_len) or table.ndim == 3 and table.shape[0] not in (1, rows):
        return None
    return np.broadcast_to(table if table.ndim == 3 else table[None], (rows, q_len, k_len))


def _request_finding(call, held, cells: np.ndarray, counted: np.ndarray) -> Finding | None:
    """A prefill call of one request (batch 1, n x n) under a padded batch's mask the program holds, (B, L, L), n <= L:
    the call is some request's block of it, its top-left one (right padding) or its bottom-right one (left padding),
    read either way round, of a request with as many real tokens as the call's queries (its own cells kept, or hidden);
    a block with padding inside (its own cells unlike) is no request's. Said where every such
    reading hides a cell the kernel lets a query see (TGI#3324: the padded mask handed to flashinfer, which reads
    request i's block flattened at its packed offset, so each request reads another's cells at the wrong row length)."""
    table = held["rows"]
    q_len, length = cells.shape[0], table.shape[-1]
    if cells.shape[1] != q_len or table.shape[-2] != length or not 2 <= q_len <= length or cross(call):
        return None  # (a request's prefill: its queries its own keys, query j key j)
    worst = None
    for i in range(table.shape[0]):
        own = np.diagonal(table[i])
        if q_len not in (int(own.sum()), int((~own).sum())):
            continue  # (not as many queries as this request's real tokens, either polarity: another request)
        for block in (table[i, :q_len, :q_len], table[i, length - q_len:, length - q_len:]):
            own = np.diagonal(block)
            if not (own.all() or not own.any()):
                continue  # padding inside the block (its own cells unlike): no request's block
            if block.all() or not block.any():
                return None  # (a block that says nothing either way: a request this call may be)
            for bad in (cells & ~block & counted[:, None], cells & block & counted[:, None]):  # (True = keep; = hide)
                if not bad.any():
                    return None  # a reading the kernel keeps to
                if worst is None or int(bad.sum()) < int(worst[1].sum()):
                    worst = (i, bad)
    if worst is None:
        return None
    i, bad = worst
    q, k = (int(x) for x in np.argwhere(bad)[0])
    said = f"{held['name']} in {held['where']}"
    return Finding("held-mask-ignored", (
        f"query {q} sees key {k}, which {said} ({table.shape[0]} requests padded to {length}) hides in the block of "
        f"every request of {q_len} tokens, whichever way round it is read ({int(bad.sum())} such cells at least, in "
        f"request {i}'s): this call of one request does not keep to the mask the program holds for the batch (a "
        "padded mask read as a packed one, or another request's?)"), expected=f"a request's block of {held['name']}",
        source=said, cell=(0, q, k))


RULES = (
    Rule("held-mask-ignored", "wrong", "call", "a query that sees a cell that a mask the program's own frames hold at the "
         "call hides, whichever way round it is read (a chunk mask, a bool mask handed down: combined by AND, or "
         "replaced by a window)", held_cells),
)
