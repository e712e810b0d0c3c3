"""Padding numbered into a real group: the group ids a model call is handed give its padding a group of its own in
one row and the real tokens' group in another, and there the mask lets pads and real tokens attend each other.

Packed or padded batches often carry, per token, the id of the group it may attend (`attention_mask` holding sample
numbers, as Moonbeam's and axolotl's collators write them; `segment_ids`; `seq_idx`), and the model keeps only
equal ids. A collator that derives the padding's id from the sample's (`sample_count * 2`, `-sample_count`, the
sample number itself for a 0-based pad id) gives it the sample's id where the derivation has a fixed point: at 0.
Read per batch row, on the model call's own ids: a row's padding is the run of one token (its pad id where the model
states one, else the token that ends or starts every padded row in a run of two or more and appears nowhere else, a
whole id vector for a compound token's (B, L, F) fields) at one edge of the row. Where one row's group ids hold that run
apart (its id met nowhere else in the row) and another row's run shares the id of the real tokens beside it, the ids
contradict their own scheme, and an attention call over the model call's rows that lets that row's pads and its
real tokens see each other is wrong (Moonbeam be25f5b: the counter started at 0, so the first piece's notes and
pads were one block). Left alone: every row alike (a scheme that never sets padding apart states nothing of it), a
0/1 attention_mask (a padding mask, arguments.py's), a row whose every token is the pad, a mask that keeps them apart,
a pad id that is also the EOS or BOS, and a run of one token that shares its group (a real EOS at the pad id).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding

GROUPS = ("attention_mask", "segment_ids", "seq_idx")  # each token's group, where the mask keeps equal ids
IDS = ("input_ids", "idx", "tokens")


def _group_ids(top) -> tuple[str, np.ndarray] | None:
    """(name, int (B, L)) of the first argument that numbers groups (an attention_mask only where it is not 0/1)."""
    for name in GROUPS:
        given = top.arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim == 2 and given.dtype.kind in "iu" and given.size \
                and (name != "attention_mask" or given.max() > 1 or given.min() < 0):
            return name, given
    return None


def _tokens(top, shape: tuple) -> np.ndarray | None:
    """Int (B, L): one number per distinct token of the model call's ids (a (B, L, F) compound token's whole vector)."""
    ids = next((top.arguments[n] for n in IDS if isinstance(top.arguments.get(n), np.ndarray)), None)
    if ids is None and isinstance(top.arguments.get("field_ids"), tuple):
        ids = top.arguments["field_ids"][1]
    if ids is None or ids.shape[:2] != shape or ids.ndim not in (2, 3):
        return None
    if ids.ndim == 2:
        return ids
    _, inverse = np.unique(ids.reshape(-1, ids.shape[-1]), axis=0, return_inverse=True)
    return inverse.reshape(shape)


def _edge_runs(tokens: np.ndarray, pad: int) -> np.ndarray:
    """Bool (B, L): each row's run of `pad` at its end, else at its start (a left-padded row)."""
    at = tokens == pad
    rows, length = at.shape
    tail = np.argmax(~at[:, ::-1], axis=1)
    head = np.argmax(~at, axis=1)
    columns = np.arange(length)[None, :]
    return np.where((tail > 0)[:, None], columns >= (length - tail)[:, None], columns < np.where(
        at[:, 0], head, 0)[:, None])


def _pad_token(top, tokens: np.ndarray) -> tuple[int, str] | None:
    """(the pad token, how it is known): the stated pad id, else the one token that pads every padded row's edge."""
    pad = top.arguments.get("pad_id")
    if isinstance(pad, int) and "field_ids" not in top.arguments:
        if pad in {top.arguments.get(n) for n in ("eos_id", "tokenizer_eos_id", "tokenizer_bos_id")}:
            return None  # (a pad id that is also the EOS or BOS ends or starts real text: its run is not padding)
        return pad, f"the pad id {pad}"
    ends = {int(row[-1]) for row in tokens if row[-1] == row[-2]} | {int(row[0]) for row in tokens if row[0] == row[1]}
    if len(ends) != 1:
        return None
    pad = ends.pop()
    runs = _edge_runs(tokens, pad)
    if runs.sum(axis=1).max() < 2 or ((tokens == pad) & ~runs).any():
        return None  # (met inside a row too: a real token, not padding)
    return pad, "the token that pads every padded row's edge"


def _rows(groups: np.ndarray, runs: np.ndarray) -> tuple[list, list]:
    """(rows whose padding has a group of its own, rows whose padding shares the group of the real tokens beside it)."""
    apart, shared = [], []
    for b in range(groups.shape[0]):
        pads, real = runs[b], ~runs[b]
        if pads.sum() < 1 or not real.any() or len(set(groups[b][pads].tolist())) != 1:
            continue
        at = np.flatnonzero(pads)
        beside = at[0] - 1 if at[0] > 0 else at[-1] + 1
        if groups[b][pads][0] == groups[b][beside]:
            if pads.sum() >= 2:  # (one token at the edge may be a real EOS at the pad id: no padding said)
                shared.append(b)
        elif not np.isin(groups[b][pads], groups[b][real]).any():
            apart.append(b)
    return apart, shared


def shared_groups(run: Run) -> list:
    """Padding given the real tokens' group id in one row, a group of its own in another, and attended as one."""
    found = []
    for top in run.tops:
        read = _group_ids(top)
        if read is None:
            continue  # (most model calls: no group ids)
        name, groups = read
        tokens = _tokens(top, groups.shape)
        pad = None if tokens is None or tokens.shape[1] < 3 else _pad_token(top, tokens)
        if pad is None:
            continue
        runs = _edge_runs(tokens, pad[0]) & ~(tokens == pad[0]).all(axis=1, keepdims=True)
        apart, shared = _rows(groups, runs)
        if not apart or not shared:
            continue
        rows, length = groups.shape
        bad_rows = np.zeros(rows, bool)
        bad_rows[shared] = True
        for call in run.made_by(top):
            if run.top(call) is not top or call.stored is None or cross(call) or call.shape[2:] != (length, length) \
                    or call.shape[0] != rows or queries(call, top)[0] != 0:
                continue
            cells = keep(call)
            if cells is None or cells.shape[0] not in (1, rows):
                continue
            cells = np.broadcast_to(cells.any(axis=1), (rows, length, length))
            pads = runs & bad_rows[:, None]
            mixed = cells & ((pads[:, :, None] & ~runs[:, None, :]) | (~runs[:, :, None] & pads[:, None, :]))
            if not mixed.any():
                continue
            b, q, k = first_cell(mixed)
            a = apart[0]
            found.append((call, Finding("padding-shares-group", (
                f"the {name} given to {top.where} numbers each token's group, and sets the padding ({pad[1]}) apart "
                f"in batch row {a} (id {int(groups[a][runs[a]][0])}), but in batch row {b} its padding has the id "
                f"{int(groups[b][runs[b]][0])} of the real tokens beside it: query {q} sees key {k} across padding and "
                f"real tokens ({int(mixed.sum())} such cells; a pad id derived from the sample's that is the same at 0?)"),
                expected="the padding a group of its own in every row", source=f"{name} of {top.where}",
                cell=(b, q, k))))
            break
    return found


RULES = (
    Rule("padding-shares-group", "wrong", "steps", "group ids (a numbered attention_mask, segment_ids) that set the "
         "padding apart in one row and give it the real tokens' id in another, where the mask then lets that row's "
         "pads and real tokens attend each other", shared_groups),
)
