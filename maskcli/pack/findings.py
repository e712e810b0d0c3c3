"""The check of a packed batch: fields side by side, each path's mask, what leaks, and the verdict.

Cells are counted on key intervals, over real query tokens only: what a padding token's own
query sees changes no loss, so paths that differ there alone agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from maskcli.diff import Difference, RowDifference
from maskcli.intervals import Intervals
from maskcli.mask import build
from maskcli.pack import boundaries as bd
from maskcli.pack.fields import Batch
from maskcli.pack.paths import Model, Path, documents, every_path
from maskcli.positions import Frame
from maskcli.text import Finding

IGNORE = -100  # the label the losses skip
FIRST = 5


@dataclass(frozen=True)
class PathCheck:
    path: Path
    cross_cells: int | None  # cells where a real token sees another document (None: no documents known)
    first_cross: list[tuple[int, int, int]]  # (row, query, key)
    pad_cells: int  # cells where a real token sees padding


@dataclass(frozen=True)
class Report:
    batch: Batch
    fields: list[bd.Boundaries]
    reference: bd.Boundaries | None
    pad: np.ndarray  # bool (B, L): a token some field calls padding
    disagreements: list[bd.Disagreement]
    checks: list[PathCheck]
    differences: list[Difference]  # between applicable paths, each pair once (real query rows only)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    model: Model = field(default_factory=Model)
    majority: list[str] = field(default_factory=list)  # the fields that outvoted another to give the reference


    @property
    def paths_agree(self) -> bool:
        return all(d.equal for d in self.differences)

    @property
    def ok(self) -> bool:
        """Exit status 0: the paths agree and nothing was found."""
        return self.paths_agree and not self.findings


def check(batch: Batch, eos: int | None = None, reference: str | None = None, model: Model | None = None) -> Report:
    """The whole check: each field's boundaries, each path's mask, cells across documents and onto padding, the
    paths compared pair by pair, and the findings (`eos`: the --eos-id; `reference`: the field that says where
    the documents are; `model`: how the transformers model is called, use_cache=True unless said)."""
    model = model if model is not None else Model()
    fields = bd.every_field(batch, eos)
    pad = bd.padding(fields, batch.rows, batch.length)
    ref = bd.reference(fields, reference, pad)
    paths = every_path(batch, fields, model)
    frame = Frame(0, batch.length, 0, batch.length)
    real = ~pad
    from maskcli.kinds.padding import key_runs

    keys = key_runs(real, frame, "the tokens")
    segment = None
    if ref is not None:
        text, options = documents("segment", ref.starts, None)  # padding is cut by `keys` and `real` below
        segment = build(text, options).intervals()
    intervals: dict[str, Intervals] = {}
    for p in paths:
        if p.applies:
            twin = next((q for q in paths if q.name in intervals and _same(q, p)), None)
            intervals[p.name] = intervals[twin.name] if twin else p.intervals()
    checks: list[PathCheck] = []
    for p in paths:
        twin = next((c for c in checks if c.path.applies and p.applies and _same(c.path, p)), None)
        checks.append(PathCheck(p, twin.cross_cells, twin.first_cross, twin.pad_cells) if twin else
                      _path_check(p, intervals.get(p.name), segment, keys, real))
    differences = _differences([p for p in paths if p.applies], intervals, real)
    findings: list[Finding] = []
    notes = list(batch.notes)
    for b in fields:
        notes += b.notes
    for p in paths:
        notes += [f"{p.name}: {note}" for note in p.notes if p.applies]
    disagreements = bd.disagreements(fields, ref, pad)
    findings += _disagreeing(fields, ref, pad, disagreements, reference is not None)
    for group in _twins(checks):
        c, names = group[0], " and ".join(x.path.name for x in group)
        verb = "let" if len(group) > 1 else "lets"
        if c.cross_cells:
            r, q, k = c.first_cross[0]
            findings.append(Finding("cross-document", f"{names} {verb} tokens see another document in {c.cross_cells:,} cells "
                                    f"(first: row {r}, query {q} sees key {k}) — documents as {ref.name} says"))
        if c.pad_cells:
            findings.append(Finding("sees-padding", f"{names} {verb} real tokens see padding in {c.pad_cells:,} cells"))
    findings += [Finding("left-out", problem) for p in paths if p.applies for problem in p.problems]
    findings += _rope(batch, ref, pad)
    labels, label_notes = _labels(batch, ref, pad)
    findings += labels
    notes += label_notes
    others = [b for b in fields if not b.name.startswith("cu_")]  # what says padding besides the lengths themselves
    lengths, length_notes = _lengths(batch, bd.padding(others, batch.rows, batch.length))
    findings += lengths
    notes += length_notes
    notes += _padding_notes(pad, checks)
    group = [b.name for b in bd.majority(fields, pad)] if reference is None else []
    outvoted = len(group) > 1 and any(b.name not in group for b in bd.voters(fields))
    return Report(batch, fields, ref, pad, disagreements, checks, differences, findings, notes, model, group if outvoted else [])


def _disagreeing(fields: list[bd.Boundaries], ref: bd.Boundaries | None, pad: np.ndarray, disagreements: list[bd.Disagreement],
                 chosen: bool) -> list[Finding]:
    """Each field that disagrees with the reference, named as outvoted where the reference is the majority's."""
    group = [] if chosen else bd.majority(fields, pad)
    out = []
    for d in disagreements:
        where = "; ".join(f"row {r} position {c}: {d.reference if says else d.field} starts a document, "
                          f"{d.field if says else d.reference} does not" for r, c, says in d.first)
        tokens = f"{d.count} token{'s' * (d.count != 1)}"
        if len(group) > 1 and ref in group and d.field in {b.name for b in bd.voters(fields)}:
            names = " and ".join(b.name for b in group)
            out.append(Finding("fields-disagree", f"{d.field} disagrees with the majority of the fields ({names} agree) at {tokens}: "
                               f"{where}; each path's leak is counted against the majority's documents"))
        else:
            out.append(Finding("fields-disagree", f"{d.field} and {d.reference} disagree at {tokens}: {where}"))
    return out


def _counted(intervals: Intervals, real: np.ndarray) -> np.ndarray:
    """int64 (B, L): cells per row, zero on padding rows."""
    return np.where(real, np.broadcast_to(intervals.counts(), real.shape), 0)


def _path_check(path: Path, iv: Intervals | None, segment: Intervals | None, keys: Intervals, real: np.ndarray) -> PathCheck:
    """Cells that see padding, |iv| - |iv & keys|, and cells that see another document, |iv & keys| - |iv & keys & segment|:
    intersections only, each a pass over the rows; the few rows named are cut out and complemented alone."""
    if iv is None:
        return PathCheck(path, None, [], 0)
    on_keys = iv & keys
    seen = _counted(on_keys, real)
    pad_cells = int(_counted(iv, real).sum()) - int(seen.sum())
    if segment is None:
        return PathCheck(path, None, [], pad_cells)
    counts = seen - _counted(on_keys & segment, real)
    first = []
    for r, q in zip(*np.nonzero(counts)):
        if len(first) == FIRST:
            break
        r, q = int(r), int(q)
        first.append((r, q, (on_keys.rows(r, q, q + 1) & ~segment.rows(r, q, q + 1)).row(0, 0)[0][0]))
    return PathCheck(path, int(counts.sum()), first, pad_cells)


def _twins(checks: list[PathCheck]) -> list[list[PathCheck]]:
    """The applicable paths grouped where they build the same mask (said once, naming them all)."""
    groups: list[list[PathCheck]] = []
    for c in checks:
        if not c.path.applies:
            continue
        group = next((g for g in groups if _same(g[0].path, c.path)), None)
        if group is None:
            groups.append([c])
        else:
            group.append(c)
    return groups


def _same(a: Path, b: Path) -> bool:
    """The same expression and options build the same mask: no need to compare it cell by cell."""
    return a.expression is not None and (a.expression, a.options) == (b.expression, b.options)


def _differences(paths: list[Path], intervals: dict[str, Intervals], real: np.ndarray) -> list[Difference]:
    """Each pair once; only-A cells are |A| - |A & B|, and the first rows that differ are cut out and compared alone."""
    out: list[Difference] = []
    done: dict[tuple[int, int], Difference] = {}
    alike = [next(i for i, q in enumerate(paths) if q is p or _same(q, p)) for p in paths]  # each path's first twin
    for i, a in enumerate(paths):
        for j in range(i + 1, len(paths)):
            b = paths[j]
            key = (alike[i], alike[j])
            if key in done:
                d = done[key]
                out.append(Difference(_named(a), _named(b), d.only_a, d.only_b, d.both, d.rows))
                continue
            ia, ib = intervals[a.name], intervals[b.name]
            count_a, count_b = _counted(ia, real), _counted(ib, real)
            if key[0] == key[1]:
                out.append(Difference(_named(a), _named(b), 0, 0, int(count_a.sum()), []))
                continue
            both = _counted(ia & ib, real)
            ca, cb = count_a - both, count_b - both
            rows = []
            for r, q in zip(*np.nonzero(ca + cb)):
                if len(rows) == FIRST:
                    break
                r, q = int(r), int(q)
                ra, rb = ia.rows(r, q, q + 1), ib.rows(r, q, q + 1)
                rows.append(RowDifference(r, 0, q, ra.row(0, 0), rb.row(0, 0), (ra & ~rb).row(0, 0), (rb & ~ra).row(0, 0)))
            done[key] = Difference(_named(a), _named(b), int(ca.sum()), int(cb.sum()), int(both.sum()), rows)
            out.append(done[key])
    return out


def _named(path: Path):
    """The path's mask renamed 'hf-sdpa: <expression>', so that a Difference says which path is which."""
    from dataclasses import replace

    return replace(path.mask, text=f"{path.name}: {path.mask.text}")


def _rope(batch: Batch, ref: bd.Boundaries | None, pad: np.ndarray) -> list[Finding]:
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


def _labels(batch: Batch, ref: bd.Boundaries | None, pad: np.ndarray) -> tuple[list[Finding], list[str]]:
    """Labels at a document's edge: -100 where the loss would otherwise predict the next document's first token."""
    f = batch.fields
    if "labels" not in f:
        return [], []
    labels = f["labels"]
    findings: list[Finding] = []
    on_pad = pad & (labels != IGNORE)
    if on_pad.any():
        r, c = (int(i) for i in np.argwhere(on_pad)[0])
        findings.append(Finding("labels-on-padding", f"labels are not {IGNORE} at {int(on_pad.sum())} padding tokens (first: row {r} position {c})"))
    if ref is None:
        return findings, []
    shifted = _shifted(labels, f.get("input_ids"))
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
    wrong = at & (labels != IGNORE)
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


def _lengths(batch: Batch, pad: np.ndarray) -> tuple[list[Finding], list[str]]:
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


def _padding_notes(pad: np.ndarray, checks: list[PathCheck]) -> list[str]:
    if not pad.any():
        return []
    real = ~pad
    later = np.flip(np.cumsum(np.flip(real, axis=1), axis=1), axis=1) > 0  # a real token at or after this position
    between = pad & later
    after = pad & ~later
    parts = []
    if between.any():
        rows = sorted({int(r) for r in np.nonzero(between)[0]})
        count = int(between.sum())
        parts.append(f"{count} padding token{'s' * (count != 1)} between samples (rows {', '.join(map(str, rows[:8]))}{', ...' if len(rows) > 8 else ''})")
    if after.any():
        parts.append(f"{int(after.sum())} after the last sample")
    masked = [c.path.name for c in checks if c.path.applies and not c.pad_cells]
    unmasked = [c.path.name for c in checks if c.path.applies and c.pad_cells]
    verdict = f"masked by {', '.join(masked) or 'no path'}" + (f"; seen by {', '.join(unmasked)}" if unmasked else "")
    return [f"padding: {' and '.join(parts)}; {verdict}"]
