"""A packed batch (pack): fields that place the documents differently, attention paths that leak across documents or
onto padding or leave tokens out, position_ids that count on, labels at a document's edge, lengths that do not add up.

pack/findings.py gathers what these read (each field's boundaries, each path's cells, the reference documents) into
one Packed and asks the registry for every rule given that `batch`; nothing here builds a mask.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.registry import Rule
from maskcli.text import Finding

IGNORE = -100  # the label the losses skip
FIRST = 5  # cells, positions or rows listed where there are more


def disagreeing(disagreements: list, ref, majority: list, voters: set[str]) -> list[Finding]:
    """Each field that disagrees with the reference `ref`, named as outvoted where the reference is the `majority`'s
    (the fields that agree, empty where the user chose the reference; `voters`: the names of the fields that vote)."""
    out = []
    for d in disagreements:
        where = "; ".join(f"row {r} position {c}: {d.reference if says else d.field} starts a document, "
                          f"{d.field if says else d.reference} does not" for r, c, says in d.first)
        tokens = f"{d.count} token{'s' * (d.count != 1)}"
        if len(majority) > 1 and ref in majority and d.field in voters:
            names = " and ".join(b.name for b in majority)
            out.append(Finding("fields-disagree", f"{d.field} disagrees with the majority of the fields ({names} agree) at {tokens}: "
                               f"{where}; each path's leak is counted against the majority's documents"))
        else:
            out.append(Finding("fields-disagree", f"{d.field} and {d.reference} disagree at {tokens}: {where}"))
    return out


def leaks(twins: list, ref) -> list[Finding]:
    """Cells where real tokens see another document (as `ref` places them) or padding, said once per group of `twins`
    (the paths' checks, grouped where they build the same mask).

    A path whose mask rests on what pack cannot see and nobody stated (its `condition`: use_cache, which attention
    implementation runs) is suspicious where it leaks, with that condition named, as long as another path the batch's
    fields serve is right (no leak); where none is, the batch has no right reading and the leak is wrong."""
    found = []
    right = any(not x.cross_cells and not x.pad_cells and x.path.condition is None for group in twins for x in group)
    for group in twins:
        c, names = group[0], " and ".join(x.path.name for x in group)
        verb = "let" if len(group) > 1 else "lets"
        conditions = {x.path.condition for x in group}
        condition = next(iter(conditions)) if len(conditions) == 1 else None
        severity, where = ("suspicious", f" if {condition}") if condition and right else (None, "")
        if c.cross_cells:
            r, q, k = c.first_cross[0]
            found.append(Finding("cross-document", f"{names} {verb} tokens see another document in {c.cross_cells:,} cells "
                                 f"(first: row {r}, query {q} sees key {k}) — documents as {ref.name} says{where}", severity))
        if c.pad_cells:
            found.append(Finding("sees-padding", f"{names} {verb} real tokens see padding in {c.pad_cells:,} cells{where}",
                                 severity))
    return found


def left_out(paths: list) -> list[Finding]:
    """Tokens an applicable path never computes: those before the first token its sequences start at (its `left_out`,
    pack/paths.py; only flash_attention_2 on position_ids whose first is not their minimum leaves any out)."""
    found = []
    for p in paths:
        if p.applies and p.left_out is not None:
            first, start = p.left_out
            found.append(Finding("left-out", f"{p.name} leaves out token{'s' if first > 1 else ''} "
                                 f"{'0' if first == 1 else f'0-{first - 1}'}: flash_attention_2 starts a sequence only where "
                                 f"position_ids equal their minimum ({start}), and the first one is at token {first}, so their "
                                 "attention output is never computed (start each document's position_ids at the same value)"))
    return found


def rope(batch, ref, pad: np.ndarray) -> list[Finding]:
    """position_ids that count on across a document boundary: RoPE treats the next sample as a continuation."""
    if ref is None or ref.name == "position_ids" or "position_ids" not in batch.fields:
        return []
    positions = batch.fields["position_ids"]
    at = ref.starts.copy()
    at[:, 0] = False
    at[:, 1:] &= ~pad[:, 1:] & ~pad[:, :-1]
    on = np.zeros(at.shape, dtype=bool)
    on[:, 1:] = at[:, 1:] & (positions[:, 1:] == positions[:, :-1] + 1)
    count = int(on.sum())
    if not count:
        return []
    rows, cols = np.nonzero(on)
    shown = ", ".join(f"row {r} position {c} (position_id {int(positions[r, c])})" for r, c in zip(rows[:FIRST], cols[:FIRST]))
    return [Finding("rope-continues", f"position_ids do not restart at {count} of {ref.name}'s document starts, so RoPE "
                    f"continues across samples: {shown}")]


def labels(batch, ref, pad: np.ndarray) -> tuple[list[Finding], list[str]]:
    """Labels at a document's edge: -100 where the loss would otherwise predict the next document's first token."""
    f = batch.fields
    if "labels" not in f:
        return [], []
    given = f["labels"]
    findings: list[Finding] = []
    on_pad = pad & (given != IGNORE)
    if on_pad.any():
        r, c = (int(i) for i in np.argwhere(on_pad)[0])
        findings.append(Finding("labels-on-padding", f"labels are not {IGNORE} at {int(on_pad.sum())} padding tokens (first: row {r} position {c})"))
    if ref is None:
        return findings, []
    shifted = _shifted(given, f.get("input_ids"))
    starts = ref.starts.copy()
    starts[:, 0] = False
    starts &= ~pad
    starts[:, 1:] &= ~pad[:, :-1]  # after padding, nothing predicts across
    at = np.zeros(starts.shape, dtype=bool)
    if shifted:  # labels[i] is token i+1: the last token of a document must not predict the next one
        at[:, :-1] = starts[:, 1:]
        where = "the last token of each document, as labels already shifted take it"
    else:
        at = starts
        where = "the first token of each document, as the model shifts labels"
    total = int(at.sum())
    wrong = at & (given != IGNORE)
    count = int(wrong.sum())
    if not total or not count:
        return findings, []
    rows, cols = np.nonzero(wrong)
    shown = ", ".join(f"row {r} position {c}" for r, c in zip(rows[:FIRST], cols[:FIRST]))
    if count < total:
        findings.append(Finding("labels-across", f"labels are {IGNORE} at {total - count} of {total} document boundaries but not at "
                                f"{count} (at {where}): {shown}; the loss there predicts the next document's first token"))
        return findings, []
    return findings, [f"labels are never {IGNORE} at {where}: the loss predicts each next document's first token "
                      "(DataCollatorWithFlattening writes -100 there)"]


def _shifted(labels: np.ndarray, input_ids: np.ndarray | None) -> bool:
    """Labels already shifted (labels[i] == input_ids[i+1], as torchtitan makes them), not as HF takes them."""
    if input_ids is None or labels.shape[1] < 2:
        return False
    kept = labels != IGNORE
    same = (labels == input_ids)[kept].mean() if kept.any() else 0
    ahead = (labels[:, :-1] == input_ids[:, 1:])[kept[:, :-1]].mean() if kept[:, :-1].any() else 0
    return bool(ahead > same)


def lengths(batch, pad: np.ndarray) -> tuple[list[Finding], list[str]]:
    """Σ lengths against the tokens (and the tokens that other fields do not call padding), max_length against the
    longest document, cu_seq_lens_q against _k."""
    f = batch.fields
    findings: list[Finding] = []
    notes: list[str] = []
    tokens, real = batch.tokens, int((~pad).sum())
    for name in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k"):
        if name in f and "cu_seqlens_padded" not in f:
            total = int(f[name][-1])
            if total not in (tokens, real):
                findings.append(Finding("lengths-sum", f"{name} adds up to {total} tokens, but the batch has {tokens} ({real} not padding): "
                                        f"tokens {total}-{tokens - 1} of the flattened batch are in no document"))
            elif total != tokens:
                notes.append(f"{name} adds up to {total} of {tokens} tokens: the rest is padding, which varlen attention leaves out")
    if "cu_seqlens_padded" in f and int(f["cu_seqlens_padded"][-1]) != tokens:
        findings.append(Finding("lengths-sum", f"cu_seqlens_padded ends at {int(f['cu_seqlens_padded'][-1])}, but the batch has {tokens} tokens"))
    if "cu_seq_lens_q" in f and "cu_seq_lens_k" in f and not np.array_equal(f["cu_seq_lens_q"], f["cu_seq_lens_k"]):
        findings.append(Finding("q-k-differ", "cu_seq_lens_q and cu_seq_lens_k differ: in self-attention over one packed batch they are the same"))
    for name, cu_name in (("max_length_q", "cu_seq_lens_q"), ("max_length_k", "cu_seq_lens_k")):
        cu = f.get(cu_name, f.get("cu_seqlens"))
        if name in f and cu is not None:
            given, longest = int(f[name].reshape(-1)[0]), int(np.diff(cu).max())
            if given < longest:
                findings.append(Finding("max-length", f"{name} is {given}, but the longest document is {longest} tokens: "
                                        "flash-attn sizes its work by it, and a smaller value gives wrong results"))
            elif given > longest:
                notes.append(f"{name} is {given}, more than the longest document ({longest}): correct, only slower")
    return findings, notes


# What each rule is given: pack/findings.py's Packed, taken as it comes (checks/ imports nothing of pack/): the batch,
# the `reference` documents, `pad`, the fields' `disagreements`, the `majority` that outvoted another and the fields
# that vote (`voters`), the paths' checks grouped where they build the same mask (`twins`), the `paths`, the padding
# the fields besides the lengths say (`others_pad`), and `notes`, where a rule adds what it says that is no finding.

def on_fields(p) -> list[Finding]:
    return disagreeing(p.disagreements, p.reference, p.majority, p.voters)


def on_paths(p) -> list[Finding]:
    return leaks(p.twins, p.reference) + left_out(p.paths)


def on_rope(p) -> list[Finding]:
    return rope(p.batch, p.reference, p.pad)


def on_labels(p) -> list[Finding]:
    found, notes = labels(p.batch, p.reference, p.pad)
    p.notes.extend(notes)
    return found


def on_lengths(p) -> list[Finding]:
    found, notes = lengths(p.batch, p.others_pad)
    p.notes.extend(notes)
    return found


RULES = (
    Rule("fields-disagree", "wrong", "batch", "two fields of a packed batch that place the documents differently",
         on_fields, "batch"),
    Rule("cross-document", "wrong", "batch", "an attention path that lets tokens see another document", on_paths, "batch"),
    Rule("sees-padding", "wrong", "batch", "an attention path that lets real tokens see padding", on_paths, "batch"),
    Rule("rope-continues", "wrong", "batch", "position_ids that count on across a document boundary", on_rope, "batch"),
    Rule("labels-on-padding", "wrong", "batch", "labels that are not -100 on padding", on_labels, "batch"),
    Rule("labels-across", "wrong", "batch", "labels that predict the next document's first token at some boundaries",
         on_labels, "batch"),
    Rule("lengths-sum", "wrong", "batch", "cu_seqlens that do not add up to the batch's tokens", on_lengths, "batch"),
    Rule("q-k-differ", "wrong", "batch", "cu_seq_lens_q and cu_seq_lens_k that differ in self-attention", on_lengths,
         "batch"),
    Rule("max-length", "wrong", "batch", "max_length below the longest document", on_lengths, "batch"),
    Rule("left-out", "wrong", "batch", "tokens an attention path never computes (transformers' flash path takes the "
         "documents from where position_ids equal their minimum, so tokens before the first such start get no output)",
         on_paths, "batch"),
)
