"""Which maskcli kind rebuilds a mask tensor exactly, and the command that does it.

A structure is only ever *recognised by rebuilding*: each kind in the registry reads
candidate parameters off the tensor (a window from the widest row, chunk labels from where
rows' visible prefixes end, ...), then maskcli builds that mask and it must equal the
tensor cell for cell. So the command suggested always rebuilds the mask exactly.

Candidates are built from their terms (kinds bound to values), with no text to parse, and asked all at once
(`candidates.matching`: one table of their key intervals at the positions the options give, compared with the
tensor's own runs, read once, in one pass), with no Mask made; a Mask is built only for the first whose cells are
the tensor's. Its shorter command (without --len) is checked on its positions (`mask.placing`), and its text, the
only one printed, parsed back to the same terms (else rebuilt from the text), so that the command shown rebuilds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from maskcli.errors import MaskError
from maskcli.expression import parse
from maskcli.inspect.candidates import MAX_LABELS, REFUSED, bare, candidates, lacks_at, made_of, matching, placed_at, on_terms, profile, read_each, runs, same_cells, table  # noqa: F401  (on_terms, same_cells: recognition's, for its tests)
from maskcli.intervals import Intervals, NotFew, same_each
from maskcli.keypadding import options as _padding_options
from maskcli.kinds.padding import key_runs
from maskcli.kinds.values import Labels
from maskcli.mask import Mask, MaskOptions
from maskcli.mask import build as build_mask
from maskcli.mask import from_terms
from maskcli.mask import placed as _placed
from maskcli.mask import placing as _placing
from maskcli.positions import DEFAULT_LEN
from maskcli.terms import Term, resolve
from maskcli.text import shell_quote

FLAGS = {
    "length": "--len", "offset": "--offset", "kv_start": "--kv-start", "kv_len": "--kv-len", "align": "--align",
    "heads": "--heads", "lengths": "--lengths", "pad": "--pad", "ids": "--ids", "pad_id": "--pad-id",
}


@dataclass(frozen=True)
class Structure:
    expression: str | None  # a maskcli expression that rebuilds it, or None
    options: dict = field(default_factory=dict)  # MaskOptions fields
    mask: Mask | None = None
    command: str | None = None
    reading: str = "mask"  # "mask" (Lq, Lk cells), "key padding [B, S]" or "key padding row"
    note: str = ""
    also: str | None = None  # another command that rebuilds it, where one reading is not enough
    kind: str | None = None  # the kind at its heart (causal, window, ...)
    closest: dict | None = None  # where nothing rebuilds it: the kind with the fewest cells apart, and where they differ

    @property
    def params(self) -> dict:
        if self.mask is None or self.mask.expression is None:
            return {}
        return self.mask.json()["params"]


def command_for(expression: str, options: dict) -> str:
    """The `maskcli show` command that rebuilds the mask."""
    parts = ["maskcli", "show", shell_quote(expression)]
    for key, value in options.items():
        parts += [FLAGS[key], shell_quote(str(value))]
    return " ".join(parts)


def fully_masked_rows(keep: np.ndarray) -> np.ndarray:
    """Bool (B, H, Lq): rows that see no key at all."""
    return ~keep.any(axis=-1)


REBUILD_CELLS = 1 << 24  # cells of a candidate built cell by cell to compare with a key padding row


def _rebuild(expression, options: dict, keep: np.ndarray, rows: Intervals | None = None, compared: bool = False,
             known: dict | None = None, matched: bool = False) -> Mask | None:
    """The Mask when `expression` (a tree of terms, or text to parse) with `options` is exactly `keep` (B, H, Lq, Lk);
    a row of size 1 compares by broadcasting. A tree is compared on its terms first (`matching`, unless `compared`
    says the table did; `rows`: the tensor's first batch row and head as `runs` gives them): a Mask is built only
    for a candidate whose cells are the tensor's, and then checked on every batch row and head: on the positions the
    table placed it at, where `known` holds them (`placed_at`), else placed again. `matched`: the table found its
    intervals the tensor's `rows` (then a Mask made of those very intervals is not compared again)."""
    single = keep.shape[:2] == (1, 1) and keep.shape[2] != 1  # one batch row and head: its runs are all its cells
    if rows is None and (single or not isinstance(expression, str) and keep.shape[2] != 1 and not compared):
        rows = runs(keep[0, 0])
    if not isinstance(expression, str) and keep.shape[2] != 1 and not compared:
        if matching([(expression, options)], keep.shape[2:], rows)[0] is False:
            return None
    made = None
    try:
        place = placed_at(options, known) if known is not None and not isinstance(expression, str) else None
        if place is not None and place != REFUSED:
            made = made_of(expression, place, known)
            built = from_terms(expression, place[0], options.get("heads", 1), made=made)
        else:
            built = build_mask(expression, MaskOptions(**options)) if isinstance(expression, str) else _placed(expression, MaskOptions(**options))
    except MaskError:
        return None
    batch, heads, q_len, k_len = keep.shape
    f = built.frame
    if f.k_len != k_len or built.batch not in (1, batch) or built.heads not in (1, heads):
        return None
    if f.q_len != q_len and q_len != 1:
        return None
    if q_len == 1 and f.q_len != 1:  # a [B, 1, 1, S] row stands for every query, so every built row must be it
        if built.exact and f.k_start == 0:  # on intervals: O(S) for a key padding row of any length
            if heads > 1 and not (keep == keep[:, :1]).all():
                return None  # (a key padding row is one per batch row: heads that differ are not it)
            try:
                wanted = key_runs(keep[:, 0].reshape(batch, k_len), f)
            except NotFew:
                return None
            got = built.intervals()
            apart = int((got & ~wanted).counts().sum()) + int((wanted & ~got).counts().sum())
            return built if apart == 0 else None
        if f.q_len * k_len > REBUILD_CELLS:  # a square of S x S cells to compare one row against: not tried
            return None
        cells = built.dense()
        return built if bool((cells == keep).all()) else None
    if single and rows is not None and built.batch == 1 and built.exact and f.k_start == 0:  # on intervals: no
        if matched and made is not None and built.intervals() is made:  # second Lq x Lk array of cells; the very
            return built  # intervals `matching` found the tensor's (no key padding cut them: made_of)
        return built if bool(same_each(built.intervals(), rows)[0]) else None
    cells = built.dense()  # (B', 1, Lq', Lk)
    return built if np.array_equal(np.broadcast_to(cells, keep.shape), keep) else None


def _placed_alike(tree, options: dict, built: Mask) -> bool:
    """Whether `tree` with `options` is placed where `built` is (mask.placing: the same positions make the same
    Mask of the same terms), with no second Mask. A term whose kind fixes no length (no labels, no draft tree) with
    no key padding given: nothing but --len says how many queries, so without it placing gives the default length."""
    f = built.frame
    if isinstance(tree, Term) and set(options) <= {"heads"} and tree.kind.queries is None and (
            tree.kind.sequence is None or tree.kind.sequence(tree.values) is None):
        return (f.q_start, f.q_len, f.k_start, f.k_len) == (0, DEFAULT_LEN, 0, DEFAULT_LEN)
    try:
        frame = _placing(tree, MaskOptions(**options))[0]
    except MaskError:
        return False
    return (frame.q_start, frame.q_len, frame.k_start, frame.k_len) == (f.q_start, f.q_len, f.k_start, f.k_len)


def _parsed_alike(expression: str, tree) -> bool:
    """Whether the text shown parses back (as `maskcli show` reads it) to the very terms it was made of: then it
    builds the Mask they built, with no second one; else the caller builds it from the text. Terms of whole numbers
    and choices alone (no labels: those may be written as sizes or a file) print as they parse, so their text is not
    parsed again (tests/test_inspect_structure.py holds every recognised kind's text to it)."""
    if isinstance(tree, Term) and not any(isinstance(value, Labels) for _, value in tree.params):
        return True
    try:
        again, _ = resolve(parse(expression), {}, expression)
    except MaskError:
        return False
    return again == tree


def closest(keep: np.ndarray, listed: list[tuple[str, object, dict]]) -> dict | None:
    """The single-kind candidate (of `listed`, `candidates`') with the fewest cells apart from the tensor, and its
    first differing rows in words. Every candidate placed by one `table`; a Mask is built for the one named."""
    from maskcli.diff import compare, row_words
    from maskcli.mask import from_tensor

    if keep.shape[2] * keep.shape[3] > 1 << 20:
        return None
    scored = []  # (cells apart, order, term, options, its Mask where one was built to count them)
    for order, ((_, term, options), seen) in enumerate(zip(listed, table([(term, options) for _, term, options in listed]))):
        if seen == REFUSED:
            continue
        built = None
        if seen is None:  # the terms cannot say alone: a Mask's cells
            try:
                built = _placed(term, MaskOptions(**options))
                cells = built.dense()
            except MaskError:
                continue
        else:
            frame, got, cut = seen
            cells = (got if cut is None else got & cut).dense(0, 0, frame.q_len)[None, None]
        if cells.shape[2:] != keep.shape[2:]:
            continue
        scored.append((int((np.broadcast_to(cells, keep[:, :1].shape) != keep[:, :1]).sum()), order, term, options, built))
    for apart, _, term, options, built in sorted(scored, key=lambda item: item[:2]):  # fewest apart, then the simplest
        try:
            built = built or _placed(term, MaskOptions(**options))  # a Mask for the one named only
        except MaskError:
            continue
        expression = built.text
        tensor = from_tensor(np.ascontiguousarray(keep[:, :1]), "the tensor", built.q_offset, built.kv_offset)
        difference = compare(tensor, from_tensor(np.broadcast_to(built.dense(), keep[:, :1].shape).copy(), expression, built.q_offset, built.kv_offset))
        return {"expression": expression, "command": command_for(expression, options), "cells_apart": apart,
                "rows": row_words(difference, "the tensor", expression)}
    return None


def readings(ones: np.ndarray, key_padding: bool = False) -> list[tuple[str, Structure, bool]]:
    """A bool tensor read both ways round, for polarity to score (one call, not one per reading): for True = attend
    and True = masked, (that meaning, the Structure that rebuilds it read so, whether some query then sees no key)."""
    found, places = [], {}  # (the placements' Frames, made once for both readings)
    both = (("attend", ones), ("masked", ~ones))
    for (meaning, keep), ahead in zip(both, _read_both(both, places)):
        found.append((meaning, recognise(keep, key_padding=key_padding, marked=meaning, places=places, ahead=ahead),
                      bool(fully_masked_rows(keep).any())))
    return found


def _read_both(both, places: dict) -> list[dict | None]:
    """What `recognise` reads of each reading before it compares a candidate's Mask, read for both readings in one
    call (`candidates.read_each`: their runs, profiles, candidates and the first table's verdicts), where both take
    that path (one head, more queries than one and no more than keys); else None each: each reads its own."""
    batch, heads, q_len, k_len = both[0][1].shape
    if heads != 1 or q_len == 1 or q_len > k_len:
        return [None] * len(both)
    setups, asked = [], []
    for meaning, keep in both:
        setup = _setup(keep4=keep, q_start=None)
        seen = setup[1]
        padding = _padding_options(seen) if not bool(seen.all()) else None
        known = {"places": places}
        setups.append((setup, padding, known))
        asked.append((keep[0, 0], setup[3], setup[2] == 0, setup[6], meaning, padding is None, {}, known))
    read = read_each(asked, (q_len, k_len))
    lacks = []  # what the composites are ruled out by, read once too (a loop: in this frame, right after read_each)
    for each, (_, _, known) in zip(read, setups):
        lacks.append(lacks_at(each[0], {"length": q_len}, True, known) if q_len == k_len <= MAX_LABELS else frozenset())
    return [{"setup": setup, "padding": padding, "known": known, "read": each, "lacks": lacked}
            for (setup, padding, known), each, lacked in zip(setups, read, lacks)]


def _setup(keep4: np.ndarray, q_start: int | None) -> tuple:
    """(keep's first head, keys some query sees per batch row, the batch row with the most keys and its cells, the
    queries' column at the end of the keys, the options placing them there, every placement tried, whether
    `q_start` placed them): where recognise reads a tensor from."""
    batch, heads, q_len, k_len = keep4.shape
    keep = keep4[:, :1]
    seen = keep[:, 0].any(axis=1)  # (B, Lk): keys that some query sees
    chosen = int(seen.sum(axis=1).argmax())
    ref = keep[chosen, 0]  # the batch row with the most keys in use
    at_end = k_len - q_len
    base = {"length": q_len, **({"offset": at_end} if at_end else {})}
    placements = [(base, at_end)] + ([({"length": q_len, "kv_len": k_len}, 0)] if at_end else [])
    placed = q_start is not None and 0 <= q_start < at_end
    if placed:  # the program says where the queries sit: that placement first, and the keys after them are later
        base = {"length": q_len, "kv_len": k_len, **({"offset": q_start} if q_start else {})}
        placements = [(base, q_start)] + [p for p in placements if p[1] != q_start]
        seen = seen.copy()
        seen[:, q_start + q_len:] = True  # keys no query sees for being later are not padding
    return keep, seen, chosen, ref, at_end, base, placements, placed


def recognise(keep4: np.ndarray, key_padding: bool = False, marked: str = "attend", nearest: bool = False,
              q_start: int | None = None, padding: dict | None = None, places: dict | None = None,
              ahead: dict | None = None) -> Structure:
    """The expression (and options) whose mask is exactly this keep mask (B, H, Lq, Lk), or expression None.

    The queries are taken to sit at the end of the keys (bottom-right, as a cache puts them).
    `key_padding`: the tensor was 2-D, so it may also be a [B, S] key padding mask; that
    reading is used when the (Lq, Lk) reading matches nothing and the tensor is not square.
    `marked`: what the file's True/1/nonzero cells mean, "attend" or "masked" (picks tril or triu).
    `nearest`: where nothing rebuilds it, find the closest kind and where it differs.
    `q_start`: the key column the first query sits at, where the program says so (a static cache's slots not yet
    written lie after the queries): that placement is tried first.
    `padding`: the key padding the call's own key-padding argument gave (maskcli.keypadding fields; {} for none),
    where it had one: then that is the padding, not keys that no query sees (an inverted mask's first key).
    `places`: the placements another reading of the same tensor worked out (candidates.placed_at), shared.
    `ahead`: what `_read_both` read of this reading with the other one (its runs, candidates and first verdicts).
    """
    batch, heads, q_len, k_len = keep4.shape
    if heads > 1 and not bool((keep4 == keep4[:, :1]).all()):
        per_head = []
        for h in range(min(heads, 8)):
            found = recognise(keep4[:, h : h + 1], marked=marked)
            per_head.append(f"head {h}: {found.command.removeprefix('maskcli show ') if found.expression else 'none'}")
        more = f"; {heads - 8} more" if heads > 8 else ""
        return Structure(None, note=f"the heads differ, and a maskcli expression is the same for every head ({'; '.join(per_head)}{more})")
    if q_len > k_len:  # no self-attention's (its keys hold its queries' own): a decoder over shorter memory, all of it
        shape = {"length": q_len, "kv_len": k_len, **({"heads": heads} if heads > 1 else {})}  # or its right padding
        seen = keep4[:, 0].any(axis=1)
        lengths = seen.sum(axis=1)
        if (lengths > 0).all() and np.array_equal(seen, np.arange(k_len)[None, :] < lengths[:, None]):
            options = shape if seen.all() else {**shape, "lengths": ",".join(map(str, lengths.tolist()))}
            built = _rebuild(bare("padding" if "lengths" in options else "full"), options, keep4)
            if built is not None:
                kind = "padding" if "lengths" in options else "full"
                return Structure(kind, options, built, command_for(kind, options), "mask", kind=kind)
        return Structure(None, note=f"more queries ({q_len}) than keys ({k_len}): maskcli puts the queries among the keys")
    head_option = {"heads": heads} if heads > 1 else {}
    keep, seen, chosen, ref, at_end, base, placements, placed = ahead["setup"] if ahead else _setup(keep4, q_start)
    stated = bool(padding)
    if ahead is not None:
        padding = ahead["padding"]
    elif padding is not None:
        padding = padding or None
    else:
        padding = _padding_options(seen) if not bool(seen.all()) else None

    # the tensor's cells as intervals, each candidate's compared to
    rows = ahead["read"][0] if ahead else runs(keep4[0, 0]) if q_len != 1 else None

    def found(kind: str, tree, options: dict, reading: str = "mask", note: str = "", compared: bool = False,
              matched: bool = False) -> Structure | None:
        options = {**options, **head_option}
        built = _rebuild(tree, options, keep4, rows, compared, known if compared else None, matched)
        if built is None:
            return None
        if "length" in options and "offset" not in options and "kv_len" not in options:
            shorter = {key: value for key, value in options.items() if key != "length"}
            if _placed_alike(tree, shorter, built):  # the data says the length: say no more
                options = shorter
        expression = built.text  # the command shown must rebuild it too: its text parsed back, once per structure
        if not _parsed_alike(expression, tree) and _rebuild(expression, options, keep4) is None:
            return None
        if batch > 1 and built.batch == 1:
            note = (note + " " if note else "") + f"(the file repeats it for each of its {batch} batch rows)"
        return Structure(expression, options, built, command_for(expression, options), reading, note, kind=kind)

    def first(listed: list[tuple[str, object, dict]], verdicts: list | None = None) -> Structure | None:
        """The first of the candidates that rebuilds the tensor: all of them compared in one `matching` (`verdicts`:
        where it was, as `_read_both` does the first)."""
        placed = [(kind, tree, {**options, **head_option}) for kind, tree, options in listed]
        if verdicts is None:
            verdicts = matching([(tree, options) for _, tree, options in placed], (q_len, k_len), rows, known) if q_len != 1 else [None] * len(placed)
        for (kind, tree, options), verdict in zip(placed, verdicts):
            structure = found(kind, tree, options, compared=True, matched=verdict is True) if verdict is not False else None  # None: a Mask's cells say
            if structure is not None:
                return structure
        return None

    if q_len == 1 and k_len > 1:
        decode = found("causal", bare("causal"), {**base, **(padding or {})})
        if padding is not None and not placed:
            row = found("padding", bare("padding"), {"length": k_len, **padding}, "key padding row",
                        "the query dimension is 1, so this one row of keys applies to every query")
            if row is not None:
                return replace(row, also=decode.command if decode else None)
        if decode is not None:
            return replace(decode, note="a single decode step: the one query sees every key up to its own position")
    if stated and not placed:  # the program's padding explains every row: key padding, as the program meant it
        alone = found("padding", bare("padding"), {**base, **padding})  # (not sink(n) or prefix(n), the same cells by chance)
        if alone is not None:
            return alone
    if ahead is not None:  # read with the other reading (`_read_both`), as below
        known, (_, rows_read, read, verdicts) = ahead["known"], ahead["read"]
    else:
        rows_read = profile(ref, 0, 0, marked, rows if chosen == 0 else None)  # once: each placement, and the composites, read it
        # once: the placements read the same with and without the padding (so only what padding cannot cut rules a kind
        # out); every kind's where the closest is asked for (it may be a kind the tensor rules out)
        known = {} if places is None else {"places": places}  # each placement's positions and what the tensor lacks there, worked out once (placed_at)
        read = candidates(ref, placements, marked, rows_read, None if nearest else rows, uncut=padding is None, known=known,
                          made=rows)  # each candidate's intervals made as it is read, for `first`'s table
        verdicts = None
    for extra in [{}] if padding is None else [{}, padding]:
        if extra:
            alone = found("padding", bare("padding"), {**base, **extra})
            if alone is not None:
                return alone
        structure = first([(kind, tree, {**options, **extra}) for kind, tree, options in read], None if extra else verdicts)
        if structure is None and q_len == k_len and k_len <= MAX_LABELS:  # then masks of two kinds
            from maskcli.inspect.composite import composites

            lacks = frozenset() if extra else ahead["lacks"] if ahead else lacks_at(rows, {"length": q_len}, True, known)  # a form ruled out is not read
            listed = [(kind, tree, {"length": q_len, **extra}) for kind, tree in composites(rows_read, ref, lacks)]
            structure = first(listed) if listed else None
        if structure is not None:
            return structure
    if key_padding and heads == 1 and batch == 1 and q_len != k_len:  # a square one is (L, L): B == S would be a coincidence
        rows = keep4[0, 0]  # read as [B, S]: each row is one batch item's keys
        options = _padding_options(rows)
        if "lengths" not in options or max(map(int, options["lengths"].split(","))) != k_len:
            options = {"length": k_len, **options}  # else the longest length says it
        built = _placed(bare("padding"), MaskOptions(**options))
        if built.frame.k_len == k_len and np.array_equal(built.dense()[:, 0, 0], rows):
            return Structure("padding", options, built, command_for("padding", options), "key padding [B, S]",
                             f"read as a key padding mask: {q_len} batch rows of {k_len} keys", kind="padding")
    return Structure(None, note="no maskcli kind rebuilds it exactly", closest=closest(keep4, read) if nearest else None)
