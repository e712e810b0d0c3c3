"""Every candidate name of one keep matrix, read, placed and compared with the tensor at once: the table recognition
asks.

Each kind reads its candidate parameters off the tensor's profile, once per placement, and every kind is asked in one
call per reading (`candidates`, `kinds.base.recognised`: each kind module entered once), which binds them and makes
their intervals at their placement too. `table` groups the candidates by the options that place them: each group's
positions are resolved once (`placing`: a Frame, and its key padding's intervals), the intervals `candidates` made are
taken as they are and any others made in one call (`terms.placed_each`), and `matching` compares every candidate with the tensor's own
runs (`runs`, read once) in one pass: one stack of intervals, a batch row per candidate. Before that, a candidate
whose kinds declare something the tensor lacks at its positions (`lacking`, read once per placement: a later key
seen, a query that does not see itself or position 0) is ruled out and never made (`ruled_out`). No Mask is made
here: structure.py builds one for the candidate it names.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from maskcli.batchdata import pad_side, padding, with_padding
from maskcli.errors import MaskError
from maskcli.expression import And, Or
from maskcli.intervals import MAX_PER_ROW, Intervals, NotFew, same_each, stacked
from maskcli.kinds import all_kinds
from maskcli.kinds import get as get_kind
from maskcli.kinds.base import NOT_MADE, Kind, Profile, recognised
from maskcli.kinds.padding import key_runs, query_runs, row_blocks
from maskcli.mask import MaskOptions
from maskcli.positions import Frame
from maskcli.terms import Term, placed_each
from maskcli.terms import intervals as intervals_of

MAX_LABELS = 4096  # label kinds are read off masks up to this long; longer labels make no useful command
PLACING = {"length", "offset", "kv_len", "heads"}  # options that only say where the queries sit (and the heads)
PADDING = {"lengths", "pad", "ids", "pad_id"}  # the key padding recognition reads off a tensor (keypadding.options)
REFUSED = "refused"
RULED_OUT = "ruled out"  # its kinds' declarations say it cannot make the tensor's cells (`ruled_out`)


def bare(name: str) -> Term:
    """The term of a kind with no parameters (causal, full, padding)."""
    return Term(get_kind(name), ())


def profile(ref: np.ndarray, q_start: int, k_start: int, marked: str, rows: Intervals | None = None) -> Profile:
    """What the kinds read candidates from: first and last visible key per row, in absolute positions. `rows`: `ref`'s
    runs where the caller has them (then read off them, O(L): a row's first run starts it, its last non-empty one
    ends it; else off the cells)."""
    return Profile(**_profiled(ref, q_start, k_start, marked, rows))


def _profiled(ref: np.ndarray, q_start: int, k_start: int, marked: str, rows: Intervals | None) -> dict:
    """`profile`'s fields (a Profile is made where they are read: `read_each` makes both readings' in one go)."""
    q_len, k_len = ref.shape
    if rows is not None:
        starts, ends = rows.starts[0], rows.ends[0]  # (Lq, K), keys from 0, empty runs [Lk, Lk) last
        seen = ends[:, 0] > starts[:, 0]
        first, last = starts[:, 0], np.where(ends > starts, ends, 0).max(axis=1) - 1  # (an empty row: Lk and -1)
    else:
        seen = ref.any(axis=1)  # argmax of the bool rows, not a min over an int64 copy of every cell (L^2 x 8 bytes)
        first, last = np.where(seen, ref.argmax(axis=1), k_len), np.where(seen, _last(ref), -1)
    return dict(q=np.arange(q_start, q_start + q_len), first=first + k_start, last=last + k_start, seen=seen,
                k_start=k_start, k_end=k_start + k_len, marked=marked)


def _last(ref: np.ndarray) -> np.ndarray:
    """The last True column of each row (0 where none), a block of rows at a time: argmax of a reversed view copies
    the block it reads (a 20,000^2 tensor's rows at once: 400 MB)."""
    k_len = ref.shape[1]
    found = np.empty(ref.shape[0], dtype=np.int64)
    for rows in row_blocks(*ref.shape):
        found[rows] = k_len - 1 - ref[rows, ::-1].argmax(axis=1)
    return found


def candidates(ref: np.ndarray, placements: list[tuple[dict, int]], marked: str, base: Profile | None = None,
               rows: Intervals | None = None, uncut: bool = True, known: dict | None = None,
               made: Intervals | None = None) -> list[tuple[str, Term, dict]]:
    """(kind name, Term, options) read off one (Lq, Lk) keep matrix: simplest kind first, and for each kind the
    queries at the end of the keys (as a cache puts them) before top-left. A value a kind refuses (as a typed one
    would be) is no candidate. `base`: the matrix's profile with its queries from 0 where the caller has it (each
    placement moves only its queries: the rows are read once). Given the tensor's `rows` (`runs`), a kind whose
    declarations hold what the tensor lacks at a placement (`lacking`; `uncut`: no key padding will cut the
    candidates) is not asked for candidates there: `table` would rule every one of them out. `known`: the
    placements one recognition has worked out (`placed_at`). Every kind is asked in one call (`kinds.base.recognised`:
    each kind module entered once); given `made` (the tensor's rows `table` will compare them with) and `known`, each
    candidate's intervals at its placement, before any key padding, are made in that same call and kept in `known`
    for `table` (`made_at`), except where its kinds hold what the tensor lacks there (`table` rules it out unmade)."""
    base = profile(ref, 0, 0, marked) if base is None else base
    return _candidates_each([(placements, base, rows, uncut, known, made)])[0][0]


def _candidates_each(asked: list[tuple]) -> list[tuple[list[tuple[str, Term, dict]], Profile]]:
    """`candidates` of several readings, (placements, profile or its fields, rows, uncut, known, made) each, in one
    call: their Profiles made, every kind asked once for all of them (`recognised`), their Terms bound together.
    Returns each reading's candidates and its Profile."""
    bases = []
    for placements, base, *_ in asked:  # (made here, one after another)
        bases.append(Profile(**base) if isinstance(base, dict) else base)
    asks, owners = [], []  # (order, profile, lacks, frame to make the intervals on, what rules a candidate out of being made)
    for r, ((placements, _, rows, uncut, known, made), base) in enumerate(zip(asked, bases)):
        for order, (options, q_start) in enumerate(placements):
            seen = base if q_start == 0 else replace(base, q=base.q + q_start)
            frame, rules_out = None, frozenset()
            if made is not None and known is not None:
                place = placed_at(options, known)
                if place is not None and place != REFUSED and place[1] is None and made.starts.shape[1] == place[0].q_len:
                    frame, rules_out = place[0], _lacking_once(made, place[0], True, options, known)
            asks.append((len(asks), seen, lacks_at(rows, options, uncut, known), frame, rules_out))
            owners.append((r, order))
    read = recognised(all_kinds(), asks, MAX_LABELS)
    found, made_at = [[] for _ in asked], [{} for _ in asked]
    for kind, checked, at, intervals in read:
        if checked is None:  # a value the kind refuses
            continue
        r, order = owners[at]
        term = Term(kind, checked)
        found[r].append((kind.name, term, asked[r][0][order][0]))
        if intervals is not NOT_MADE:
            made_at[r].setdefault(_where(asks[at][3]), {})[id(term)] = (term, intervals)
    for (_, _, _, _, known, _), each in zip(asked, made_at):
        for where, made in each.items():
            known[("made", where)] = made
    return list(zip(found, bases))


def read_each(asked: list[tuple], shape: tuple[int, int]) -> list[tuple]:
    """Both readings of one tensor (True = attend, True = masked) read as structure.recognise reads each, in one
    call: their runs made together (`query_runs`), their profiles, every kind asked once for both (`recognised`), and
    the candidates placed with no key padding compared with each one's runs. `asked`: per reading, (its first batch
    row and head (Lq, Lk), the batch row with most keys and whether it is that first one, placements, marked, uncut,
    the options every candidate takes (its heads), and `known`, the dict that recognition keeps). Returns per reading
    (its runs, its profile, its candidates, and `matching`'s verdicts on them with those options)."""
    rows_each = query_runs([item[0] for item in asked], "the tensor")
    fields = [_profiled(ref, 0, 0, marked, rows if first else None)
              for (_, ref, first, _, marked, _, _, _), rows in zip(asked, rows_each)]
    read = _candidates_each([(placements, each, rows, uncut, known, rows)
                             for (_, _, _, placements, _, uncut, _, known), each, rows in zip(asked, fields, rows_each)])
    verdicts = _matching_each([([(tree, {**options, **extra}) for _, tree, options in found], rows, known)
                               for (_, _, _, _, _, _, extra, known), (found, _), rows in zip(asked, read, rows_each)], shape)
    return [(rows, base, found, each) for rows, (found, base), each in zip(rows_each, read, verdicts)]


def _where(frame: Frame) -> tuple[int, int, int, int]:
    return frame.q_start, frame.q_len, frame.k_start, frame.k_len


def made_of(tree, place: tuple, known: dict | None) -> Intervals | None:
    """The intervals `candidates` made of this very tree at `place` (`placed_at`'s (frame, key padding)) and kept in
    `known`, where no key padding cuts them: the Mask of the one named takes them as they are (mask.from_terms)."""
    frame, cut = place
    if known is None or cut is not None or frame.key_valid is not None:
        return None
    made = known.get(("made", _where(frame)), {}).get(id(tree))
    return made[1] if made is not None and made[0] is tree and isinstance(made[1], Intervals) else None


def lacks_at(rows: Intervals | None, options: dict, uncut: bool, known: dict | None = None) -> frozenset[str]:
    """What the tensor lacks at the positions `options` give (`lacking`), where `table` would read it; none else."""
    place = placed_at(options, known) if rows is not None else None
    if place is None or place == REFUSED or place[1] is not None or rows.starts.shape[1] != place[0].q_len:
        return frozenset()
    return _lacking_once(rows, place[0], uncut, options, known)


def placed_at(options: dict, known: dict | None):
    """`placing(options)`, worked out once per tensor: `known` is a dict its caller keeps for one recognition (the
    candidates' reading, the table, the composites and the Mask of the one named all read the same placements), and
    its "places" may be shared by the readings of one tensor (`structure.readings`: the same options, the same Frame)."""
    if known is None:
        return placing(options)
    places = known.setdefault("places", {})
    key = tuple(sorted(options.items()))
    if key not in places:
        places[key] = placing(options)
    return places[key]


def _lacking_once(rows: Intervals, frame: Frame, uncut: bool, options: dict, known: dict | None) -> frozenset[str]:
    """`lacking` at one placement, read once per recognition where `known` keeps it (the tensor's `rows` are one)."""
    if known is None:
        return lacking(rows, frame, uncut)
    key = ("lacks", tuple(sorted(options.items())), uncut)
    if key not in known:
        known[key] = lacking(rows, frame, uncut)
    return known[key]


@functools.cache
def _padding_term() -> Term:
    """The key padding's term, bound once for every candidate that is cut by it."""
    return bare("padding")


def placing(options: dict):
    """(frame, the key padding's intervals or None) at the positions `options` give, the same for every candidate
    placed by them; REFUSED where mask.placed refuses the padding; None where the terms cannot say alone (options
    beyond --len, --offset, --kv-len, --heads and the key padding, or several batch rows of padding).

    With --len given, mask.placed's positions are these: queries from --offset (else 0), keys from 0 to --kv-len
    (else to the last query), the key padding and-ed on as placed does (batchdata's own reading of it);
    tests/test_inspect_structure.py holds the two to the same frames and cells."""
    if "length" not in options or not set(options) <= PLACING | PADDING:
        return None
    length, q_start = options["length"], options.get("offset") or 0
    frame = Frame(q_start, length, 0, options.get("kv_len") or q_start + length)
    if set(options) <= PLACING:
        frame.q_column, frame.k_end, frame.n  # noqa: B018 (read once here, cached: what lacking and the kinds read)
        return frame, None
    given = MaskOptions(**options)
    try:
        lengths, ids = padding(given)
        frame = with_padding(frame, lengths, ids, given.pad_id, pad_side(given))
    except MaskError:
        return REFUSED
    if frame.batch != 1:
        return None
    if not frame.padded:
        return frame, None
    try:
        return frame, intervals_of(_padding_term(), frame)  # mask.from_terms: padding cuts every mask
    except NotFew:
        return None


def table(listed: list[tuple[object, dict]], rows: Intervals | None = None, known: dict | None = None) -> list:
    """For each (tree of terms, options): (frame, its key intervals (1, Lq, K), the key padding cut on) as
    mask.placed would place it, with no Mask; REFUSED where placed refuses it (a size its labels, its draft tree,
    its sinks or its padding do not fit); None where the terms cannot say alone (`placing`'s, intervals not few,
    several batch rows). The candidates placed alike are placed once and made in one call. Given the tensor's
    `rows` (`runs`), a candidate its kinds rule out at its positions (`ruled_out`) is RULED_OUT, never made.
    `known`: the placements one recognition has worked out (`placed_at`)."""
    found: list = [None] * len(listed)
    groups: dict[tuple, list[int]] = {}
    for i, (_, options) in enumerate(listed):
        groups.setdefault(tuple(sorted(options.items())), []).append(i)
    for key, members in groups.items():
        place = placed_at(dict(key), known)
        if place is None or place == REFUSED:
            for i in members:
                found[i] = place
            continue
        frame, cut = place
        if rows is not None and rows.starts.shape[1] == frame.q_len:
            lacks = _lacking_once(rows, frame, cut is None, dict(key), known)  # every candidate placed so reads it
            for i in [i for i in members if ruled_out(listed[i][0], lacks)]:
                found[i] = RULED_OUT
            members = [i for i in members if found[i] is None]
        made = known.get(("made", _where(frame))) if known is not None and frame.key_valid is None else None
        kept = {i: made[id(listed[i][0])][1] for i in members
                if made is not None and id(listed[i][0]) in made and made[id(listed[i][0])][0] is listed[i][0]}
        todo = [i for i in members if i not in kept]  # (`candidates` made the rest, at these positions)
        kept.update(zip(todo, placed_each([listed[i][0] for i in todo], frame)) if todo else ())
        if todo and known is not None and frame.key_valid is None:  # kept too: the Mask of the one named takes them
            known.setdefault(("made", _where(frame)), {}).update((id(listed[i][0]), (listed[i][0], kept[i])) for i in todo)
        for i, got in ((i, kept[i]) for i in members):
            if isinstance(got, MaskError):
                found[i] = REFUSED
            elif got is not None and got.starts.shape[0] == 1:
                found[i] = (frame, got, cut)
    return found


def lacking(rows: Intervals, frame: Frame, uncut: bool) -> frozenset[str]:
    """What the tensor's cells (`rows`, keys from 0) lack with its queries at `frame`'s positions, in the words of
    the kinds' declarations: "causal" where some query sees a later key; "sees_own" and "sees_first" where some query
    does not see its own position, or position 0 (asked only `uncut`: key padding may cut either, and only where they
    are keys)."""
    starts, ends = rows.starts[0], rows.ends[0]  # (Lq, K): empty intervals are [k_end, k_end)
    q = np.arange(frame.q_start, frame.q_end, dtype=np.int64)[:, None]
    lacks = set()
    if ((ends > starts) & (ends - 1 > q)).any():
        lacks.add("causal")
    if uncut and frame.k_start == 0 and frame.k_len > 0:
        if frame.q_end <= frame.k_end and not ((starts <= q) & (q < ends)).any(axis=1).all():
            lacks.add("sees_own")
        if not ((starts <= 0) & (0 < ends)).any(axis=1).all():
            lacks.add("sees_first")
    return frozenset(lacks)


def ruled_out(tree, lacks: frozenset[str]) -> bool:
    """Whether the tree's masks all hold something the tensor lacks (`lacking`), whatever their parameters, read off
    its kinds' declarations (Kind.causal, sees_own, sees_first): an And holds what one of its items holds (causal)
    or all do (sees_*), an Or the reverse; a negation is held to nothing."""
    return any(_holds(tree, fact) for fact in lacks)


def _holds(tree, fact: str) -> bool:
    """`tree`: a tree of terms, or a composite's form (composite.FORMS: a Kind, or (And | Or, form, ...))."""
    if isinstance(tree, (Term, Kind)):
        return getattr(tree.kind if isinstance(tree, Term) else tree, fact)
    joined, items = (type(tree), tree.items) if isinstance(tree, (And, Or)) else (tree[0], tree[1:]) if isinstance(tree, tuple) else (None, ())
    if joined not in (And, Or):
        return False
    each = any if (joined is And) == (fact == "causal") else all
    return each(_holds(item, fact) for item in items)


def on_terms(tree, options: dict):
    """(frame, key intervals) of one candidate's one batch row, (1, Lq, K), made from its terms at the positions
    `options` give, with no Mask (`table` of one); REFUSED or None as `table` says."""
    seen = table([(tree, options)])[0]
    if seen is None or seen == REFUSED:
        return seen
    frame, got, cut = seen
    return frame, (got if cut is None else got & cut)


def matching(listed: list[tuple[object, dict]], shape: tuple[int, int], rows: Intervals | None,
             known: dict | None = None) -> list[bool | None]:
    """For each (tree, options): True where its cells are the tensor's first batch row and head (`rows`, as `runs`
    gives them, None where a row has more runs than a few), False where they are not or mask.placed refuses it,
    None where the terms cannot say alone (then a Mask's cells must). Every candidate placed by `table`, then
    compared in one pass: one stack of intervals, a batch row per candidate, cut by its key padding."""
    return _matching_each([(listed, rows, known)], shape)[0]


def _matching_each(groups: list[tuple], shape: tuple[int, int]) -> list[list[bool | None]]:
    """`matching` of several groups, (listed, rows, known) each (the readings of one tensor: each its own runs), in
    one pass: every candidate of every group stacked, each compared with its group's runs."""
    found: list[list[bool | None]] = []
    compared = []  # (group, index, intervals, cut)
    for g, (listed, rows, known) in enumerate(groups):
        verdicts: list[bool | None] = []
        for i, seen in enumerate(table(listed, rows, known)):
            verdicts.append(False if seen in (REFUSED, RULED_OUT) else None)
            if seen is not None and seen not in (REFUSED, RULED_OUT):
                frame, got, cut = seen
                if (frame.q_len, frame.k_len) != shape:
                    verdicts[i] = False
                elif rows is None:  # a row of the tensor has more runs than a few; the candidate's, cut, fewer
                    verdicts[i] = False if got.per_row + (cut.per_row if cut is not None else 0) <= MAX_PER_ROW else None
                else:
                    compared.append((g, i, got, cut))
        found.append(verdicts)
    if compared:
        q_len, k_len = shape
        got = stacked([item[2] for item in compared], q_len, k_len)
        cuts = [item[3] for item in compared]
        if any(cut is not None for cut in cuts):  # each its own padding (none: every key)
            everything = Intervals(np.zeros((1, 1, 1), np.int64), np.full((1, 1, 1), k_len, np.int64), 0, k_len)
            got = got & stacked([everything if cut is None else cut for cut in cuts], q_len, k_len)
        same = np.zeros(len(compared), dtype=bool)
        for g in sorted({item[0] for item in compared}):  # each group's candidates (one after another) with its runs
            at = [n for n, item in enumerate(compared) if item[0] == g]
            lo, hi = at[0], at[-1] + 1
            part = got if (lo, hi) == (0, len(compared)) else Intervals(got.starts[lo:hi], got.ends[lo:hi], got.k_start, got.k_end)
            same[lo:hi] = same_each(part, groups[g][1])
        for (g, i, _, _), verdict in zip(compared, same):
            found[g][i] = bool(verdict)
    return found


def runs(keep: np.ndarray) -> Intervals | None:
    """A (Lq, Lk) keep matrix's cells as exact key intervals per query row (keys from 0), (1, Lq, K), in the normal
    form intervals.py keeps; None where a row has more runs than a few (then cells are compared)."""
    try:  # each query row read as a batch row's, keys 0..Lk (no Frame: only where the keys lie is read)
        return key_runs(keep, SimpleNamespace(k_start=0, k_end=keep.shape[1]), "the tensor", queries=True)
    except NotFew:
        return None


def same_cells(got: Intervals, want: Intervals) -> bool:
    """The same cells, counted per row: as many in each, and all of them in both (a row stored once stands for every
    row: intervals broadcast)."""
    counts = want.counts()
    return bool((got.counts() == counts).all()) and bool(((got & want).counts() == counts).all())
