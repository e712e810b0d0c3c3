"""The document boundaries each field of a batch implies, per batch row, and where fields disagree.

A field's boundaries are two bool (B, L) arrays: `starts` (a document's first token) and
`pad` (a token that belongs to no document). Everything is a few passes over the tokens.
Cumulative lengths (cu_seqlens) count over the flattened batch, as varlen kernels take it:
a document that runs past the end of a row is split there, and said so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from maskcli.errors import MaskError
from maskcli.pack.fields import Batch

# which field says where the documents are, when several do: the collator's explicit boundaries first
REFERENCE_ORDER = ("cu_seq_lens_q", "cu_seqlens_padded", "cu_seqlens", "cu_seq_lens_k", "seq_idx", "position_ids",
                   "attention_mask", "mrope_t", "eos")
FIRST = 5  # positions listed where fields disagree


@dataclass(frozen=True)
class Boundaries:
    """Where one field says documents start and which tokens it says are padding."""

    name: str  # the field: position_ids, cu_seqlens, eos, ...
    how: str  # how its boundaries are read, in words
    starts: np.ndarray  # bool (B, L): a document starts here
    pad: np.ndarray | None  # bool (B, L): padding; None where the field says nothing of padding
    documents: bool = True  # False: the field only says padding (a 0/1 attention_mask)
    notes: list[str] = field(default_factory=list)

    def labels(self) -> np.ndarray:
        """int64 (B, L) document labels: 0, 0, 1, 1, ... per row (padding runs count as documents of their own)."""
        return np.cumsum(self.starts, axis=1) - 1

    def start_positions(self, row: int) -> np.ndarray:
        return np.flatnonzero(self.starts[row])


def _first_column(starts: np.ndarray) -> np.ndarray:
    starts[:, 0] = True
    return starts


def from_position_ids(positions: np.ndarray) -> Boundaries:
    """Hugging Face's rule (find_packed_sequence_indices): a new document wherever the position does not go up by 1."""
    starts = np.ones(positions.shape, dtype=bool)
    starts[:, 1:] = np.diff(positions, axis=1) != 1
    return Boundaries("position_ids", "where position_ids do not go up by 1", starts, None)


def from_cumulative(name: str, cu: np.ndarray, rows: int, length: int, lengths: np.ndarray | None = None) -> Boundaries:
    """Documents at cu[i] over the flattened batch; tokens past cu[-1] (and, given the real `lengths` of a
    cu_seqlens_padded, past each document's real end) are padding."""
    tokens = rows * length
    starts = np.zeros(tokens, dtype=bool)
    pad = np.zeros(tokens, dtype=bool)
    begin = cu[:-1]
    starts[begin[begin < tokens]] = True
    pad[int(cu[-1]):] = True
    how = f"documents begin at {name}[i], over the flattened batch"
    if lengths is not None:
        if len(lengths) != len(begin):
            raise MaskError(f"cu_seqlens_padded has {len(begin)} documents but the real lengths have {len(lengths)}: give both for the same documents")
        short = np.flatnonzero(lengths > np.diff(cu))
        if short.size:
            i = int(short[0])
            raise MaskError(f"document {i} is {int(lengths[i])} tokens long, more than the {int(np.diff(cu)[i])} that cu_seqlens_padded gives it")
        change = np.zeros(tokens + 1, dtype=np.int64)  # +1 where a document's padding begins, -1 where it ends
        np.add.at(change, begin + lengths, 1)
        np.add.at(change, cu[1:], -1)
        pad |= np.cumsum(change)[:tokens] > 0
        how = "documents begin at cu_seqlens_padded[i] and run for the real lengths of cu_seqlens; the rest is padding"
    starts = starts.reshape(rows, length)
    notes = []
    crossing = np.flatnonzero((~starts[1:, 0]) & (~pad.reshape(rows, length)[1:, 0]))
    if crossing.size:
        notes.append(f"{name}: a document runs from the end of row {int(crossing[0])} into row {int(crossing[0]) + 1}; "
                     "varlen attention over the flattened batch lets it see across the rows; here it is split at the row's end")
    return Boundaries(name, how, _first_column(starts), pad.reshape(rows, length), notes=notes)


def from_seq_idx(seq_idx: np.ndarray) -> Boundaries:
    starts = np.ones(seq_idx.shape, dtype=bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return Boundaries("seq_idx", "where seq_idx changes (negative: padding)", starts, seq_idx < 0)


def from_attention_mask(mask: np.ndarray) -> Boundaries:
    """0 is padding; values above 1 are document ids (packing that writes 1, 1, 2, 2, 0 into the mask)."""
    pad = mask == 0
    starts = np.zeros(mask.shape, dtype=bool)
    if mask.max(initial=0) > 1:
        starts[:, 1:] = (mask[:, 1:] != mask[:, :-1]) & ~pad[:, 1:]
        return Boundaries("attention_mask", "document ids in the 2-D attention_mask (0 = padding)", _first_column(starts), pad)
    return Boundaries("attention_mask", "2-D attention_mask: 1 = token, 0 = padding (no document boundaries)", _first_column(starts), pad, documents=False)


def from_keep_4d(keep: np.ndarray) -> Boundaries:
    """A 4-D mask's documents: a query whose first visible key is itself starts one; keys no query sees are padding."""
    cells = keep[:, 0]
    seen = cells.any(axis=2)
    first = np.where(seen, cells.argmax(axis=2), -1)
    positions = np.arange(cells.shape[-1])
    pad = ~cells.any(axis=1)
    return Boundaries("attention_mask", "4-D attention_mask: a query whose first visible key is itself starts a document",
                      _first_column(first == positions), pad)


def from_eos(input_ids: np.ndarray, eos: int) -> Boundaries:
    starts = np.zeros(input_ids.shape, dtype=bool)
    starts[:, 1:] = input_ids[:, :-1] == eos
    return Boundaries("eos", f"a document ends at each EOS token (id {eos})", _first_column(starts), None)


def every_field(batch: Batch, eos: int | None) -> list[Boundaries]:
    """The boundaries of each field the batch has, in REFERENCE_ORDER."""
    f, rows, length = batch.fields, batch.rows, batch.length
    found: dict[str, Boundaries] = {}
    padded = "cu_seqlens_padded" in f
    for name in ("cu_seq_lens_q", "cu_seqlens", "cu_seq_lens_k"):
        if name in f and not (padded and name == "cu_seqlens"):
            found[name] = from_cumulative(name, f[name], rows, length)
    if padded:
        real = f.get("cu_seqlens", f.get("cu_seq_lens_q"))
        if real is None:
            raise MaskError("cu_seqlens_padded gives where documents sit, not how long they are: give cu_seqlens (the real lengths) too")
        found["cu_seqlens_padded"] = from_cumulative("cu_seqlens_padded", f["cu_seqlens_padded"], rows, length, np.diff(real))
    if "seq_idx" in f:
        found["seq_idx"] = from_seq_idx(f["seq_idx"])
    if "position_ids" in f:
        found["position_ids"] = from_position_ids(f["position_ids"])
    if batch.mrope is not None and "position_ids" not in f:
        t = batch.mrope[0]
        if (np.diff(t, axis=1) < 0).any():  # read only where it restarts: mRoPE itself is not packing
            starts = np.ones(t.shape, dtype=bool)
            starts[:, 1:] = np.diff(t, axis=1) < 0
            found["mrope_t"] = Boundaries("mrope_t", "where the temporal mRoPE row (position_ids[0]) goes down", starts, None)
    if batch.keep_4d is not None:
        found["attention_mask"] = from_keep_4d(batch.keep_4d)
    elif "attention_mask" in f:
        found["attention_mask"] = from_attention_mask(f["attention_mask"])
    if eos is not None:
        if "input_ids" not in f:
            raise MaskError(f"--eos-id {eos}: the batch has no input_ids to find the EOS tokens in")
        if abs(eos) > 1 << 62:
            raise MaskError(f"--eos-id {eos} is too large to be a token id (at most ±{1 << 62:,})")
        found["eos"] = from_eos(f["input_ids"], eos)
    return [found[name] for name in REFERENCE_ORDER if name in found]


def reference(fields: list[Boundaries], chosen: str | None = None, pad: np.ndarray | None = None) -> Boundaries | None:
    """The field that says where the documents are: `chosen`; else the first (in REFERENCE_ORDER) of the fields that
    more than half of the voting fields agree with (one field off by one is outvoted, not believed); else the first
    in REFERENCE_ORDER that has documents. `pad`: tokens where the fields' starts are not compared."""
    if chosen is not None:
        for b in fields:
            if b.name == chosen:
                return b
        have = ", ".join(b.name for b in fields) or "none"
        raise MaskError(f"--reference {chosen!r}: the batch has no such field; the fields with boundaries are {have}")
    group = majority(fields, pad)
    return group[0] if group else next((b for b in fields if b.documents), None)


def voters(fields: list[Boundaries]) -> list[Boundaries]:
    """The fields that say where the batch's documents are (EOS is a mask to check, not a say on the batch)."""
    return [b for b in fields if b.documents and b.name != "eos"]


def majority(fields: list[Boundaries], pad: np.ndarray | None = None) -> list[Boundaries]:
    """The fields that agree with each other, where they are more than half of the voters (none: no majority)."""
    groups: list[list[Boundaries]] = []
    for b in voters(fields):
        group = next((g for g in groups if same_starts(g[0], b, pad)), None)
        if group is None:
            groups.append([b])
        else:
            group.append(b)
    best = max(groups, key=len, default=[])
    return best if 2 * len(best) > len(voters(fields)) else []


def same_starts(a: Boundaries, b: Boundaries, pad: np.ndarray | None) -> bool:
    differ = a.starts ^ b.starts
    return not (differ & ~pad if pad is not None else differ).any()


def padding(fields: list[Boundaries], rows: int, length: int) -> np.ndarray:
    """bool (B, L): a token any field calls padding."""
    pad = np.zeros((rows, length), dtype=bool)
    for b in fields:
        if b.pad is not None:
            pad |= b.pad
    return pad


@dataclass(frozen=True)
class Disagreement:
    """Where one field's document starts differ from the reference's, on tokens no field calls padding."""

    field: str
    reference: str
    count: int
    first: list[tuple[int, int, bool]]  # (row, position, the reference starts a document there)


def disagreements(fields: list[Boundaries], ref: Boundaries | None, pad: np.ndarray) -> list[Disagreement]:
    out = []
    if ref is None:
        return out
    for b in fields:
        if b is ref or not b.documents:
            continue
        differ = (b.starts ^ ref.starts) & ~pad
        count = int(differ.sum())
        if count:
            rows, cols = np.nonzero(differ)
            first = [(int(r), int(c), bool(ref.starts[r, c])) for r, c in zip(rows[:FIRST], cols[:FIRST])]
            out.append(Disagreement(b.name, ref.name, count, first))
    return out


def document_sizes(batch: Batch, where: str) -> np.ndarray:
    """The sizes of a packed row's documents where its reference field places them (shard splits one sequence of
    real tokens, and pads as its layout does, so a row with padding is refused rather than guessed at)."""
    if batch.rows != 1:
        raise MaskError(f"{where} has {batch.rows} batch rows: shard splits one sequence; give a packed batch of one row")
    fields = every_field(batch, None)
    pad = padding(fields, 1, batch.length)
    if pad.any():
        count = int(pad.sum())
        raise MaskError(f"{where} holds {count:,} padding token{'s' if count != 1 else ''}: shard splits the real tokens and pads them as "
                        "--layout does; give the batch without its padding (its cu_seqlens, not cu_seqlens_padded)")
    ref = reference(fields, None, pad)
    if ref is None:
        raise MaskError(f"{where} does not say where its documents are: give position_ids, cu_seqlens or seq_idx in it")
    return np.diff(np.r_[np.flatnonzero(ref.starts[0]), batch.length])
