"""The check of a packed batch: fields side by side, each path's mask, what leaks, and the verdict (what the rules
read is gathered into one Packed, and the registry asked for every rule given that `batch`: checks/packing.py's).

Cells are counted on key intervals, over real query tokens only: what a padding token's own
query sees changes no loss, so paths that differ there alone agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from maskcli.checks import registry
from maskcli.checks.packing import FIRST
from maskcli.diff import Difference, RowDifference
from maskcli.intervals import Intervals
from maskcli.pack import boundaries as bd
from maskcli.pack.fields import Batch
from maskcli.pack.paths import Model, Path, documents_mask, every_path
from maskcli.positions import Frame
from maskcli.text import Finding



@dataclass(frozen=True)
class PathCheck:
    path: Path
    cross_cells: int | None  # cells where a real token sees another document (None: no documents known)
    first_cross: list[tuple[int, int, int]]  # (row, query, key)
    pad_cells: int  # cells where a real token sees padding


@dataclass(frozen=True)
class Packed:
    """What a packed batch's rules read (checks/packing.py, given `batch`), worked out once here."""
    batch: Batch
    reference: bd.Boundaries | None  # the documents every path's leak is counted against
    pad: np.ndarray  # bool (B, L): a token some field calls padding
    disagreements: list[bd.Disagreement]
    majority: list[bd.Boundaries]  # the fields that agree on the reference (empty where the user chose it)
    voters: set[str]  # the names of the fields that vote
    twins: list[list[PathCheck]]  # the applicable paths' checks, grouped where they build the same mask
    paths: list[Path]
    others_pad: np.ndarray  # bool (B, L): padding as the fields besides the lengths themselves say
    notes: list[str]  # what a rule says that is no finding, in the order said


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
        """Exit status 0: nothing wrong was found, and the paths agree but for those whose mask rests on a condition
        nobody stated (their leaks are suspicious: checks/packing.py)."""
        conditional = tuple(f"{c.path.name}: " for c in self.checks if c.path.applies and c.path.condition)
        settled = [d for d in self.differences if not (d.a.text.startswith(conditional) or d.b.text.startswith(conditional))]
        return all(d.equal for d in settled) and not registry.wrong(self.findings)


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
        segment = documents_mask("segment", ref.starts, None).intervals()  # padding is cut by `keys` and `real` below
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
    notes = list(batch.notes)
    for b in fields:
        notes += b.notes
    for p in paths:
        notes += [f"{p.name}: {note}" for note in p.notes if p.applies]
    disagreements = bd.disagreements(fields, ref, pad)
    majority = bd.majority(fields, pad) if reference is None else []  # a reference the user chose is no majority's
    others = [b for b in fields if not b.name.startswith("cu_")]  # what says padding besides the lengths themselves
    read = Packed(batch, ref, pad, disagreements, majority, {b.name for b in bd.voters(fields)}, _twins(checks), paths,
                  bd.padding(others, batch.rows, batch.length), notes)
    findings: list[Finding] = registry.run("batch", read)
    notes += _padding_notes(pad, checks)
    group = [b.name for b in majority]
    outvoted = len(group) > 1 and any(b.name not in group for b in bd.voters(fields))
    return Report(batch, fields, ref, pad, disagreements, checks, differences, findings, notes, model, group if outvoted else [])


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
