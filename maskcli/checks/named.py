"""What the recogniser named: a mask that is a known one read the other way round, two names for the same cells, and
the nearest expression to a mask nothing rebuilds.

The naming is the trace report's (it runs inspect's recogniser); these rules read what it found.
"""

from __future__ import annotations

from maskcli.checks.registry import Rule
from maskcli.checks.rows import MEANT_LATER
from maskcli.text import Finding


def closest(structure) -> list[Finding]:
    """Where the expression nearest a mask that nothing rebuilds differs from it (its first rows)."""
    near = structure.closest
    if not near or not near.get("rows"):
        return []
    return [Finding("closest", f"against {near['expression']}: {'; '.join(near['rows'][:2])}")]


def same_as(structure, same: str | None) -> list[Finding]:
    """A mask the recogniser named that `same` (trace/names.py's also_documents) names too, cell for cell."""
    return [Finding("same-as", f"{structure.expression} is also {same}: the same cells")] if same is not None else []


def polarity(call, kind: str | None, named: str | None, past=None, run=None) -> list[Finding]:
    """A mask that no kind names (or a raw tril/triu) whose other reading the recogniser names (`named`, of `kind`).
    `past`: a function saying whether the model call states its queries past every key (rows.past_the_keys): the other
    reading places them among the keys (bottom-right, or top-left at a static cache's start), where they are not.
    `run`: the run's calls (checks.context.Run), where an all-hidden mask's site is read (_site_reads_as_given)."""
    if named is None or kind in MEANT_LATER or _edge_padding(call) or _one_key_each(call) or _whole_rows(call) \
            or (getattr(call, "details", None) or {}).get("nan_scores") or past is not None and past() \
            or _causal_tile(call) or _site_reads_as_given(call, run):  # (NaN: no cells)
        return []
    meaning = {"mha": "MHA reads a bool mask as True = masked", "sdpa": "SDPA reads a bool mask as True = may attend"}.get(call.api, "")
    return [Finding("polarity", f"read the other way round it is {named}: a mask in the wrong polarity?"
                    + (f" ({meaning})" if meaning else ""))]


def _one_key_each(call) -> bool:
    """The other reading lets each query see exactly one key (the mask as given hides one key a row, its own in SAITS'
    diagonally-masked attention, leave-one-out scoring): attention over one key alone copies that key's value, no
    mask anyone means, so the mask as given is read as meant."""
    from maskcli.checks.context import keep

    cells = keep(call) if getattr(call, "stored", None) is not None else None
    return cells is not None and cells.size > 0 and bool(((~cells).sum(axis=-1) == 1).all())


def _site_reads_as_given(call, run) -> bool:
    """The mask as given hides every cell, and another call of the same module path and API in the run was handed a
    mask that keeps some cells and hides others, and no padding at either end (checks/named._edge_padding): the code
    at that site turns the program's masks into the kernel's one way, and that mask's reading says which (had it been
    turned round, its own other reading is what this rule reads there). An all-hidden mask at such a site is one the
    program handed (IDEFICS run again with its image_attention_mask all 0, its text gated off every image), not a
    full mask read the wrong way round; a site where every mask is all hidden (a key padding mask of all True
    meaning all real) is still said."""
    from maskcli.checks.context import keep

    cells = keep(call) if getattr(call, "stored", None) is not None else None
    if run is None or cells is None or not cells.size or cells.any() or not getattr(call, "where", ""):
        return False
    masks = {call.mask}
    for other in run.calls:
        if other.where != call.where or other.api != call.api or other.mask in masks or other.stored is None:
            continue
        masks.add(other.mask)
        given = keep(other)
        if given is not None and given.any() and not given.all() and not _edge_padding(other):
            return True
    return False


def _causal_tile(call) -> bool:
    """The call is one tile of a blockwise kernel (checks/tiled.py) whose mask hides only keys after their queries, at
    their places in the whole (memory-efficient-attention-pytorch's causal mask rebuilt per chunk pair): a tile all
    after its queries is all hidden, and its other reading (full) is no sign of a polarity slip."""
    from maskcli.checks.context import keep
    from maskcli.checks.tiled import hides_only_later

    cells = keep(call) if getattr(call, "stored", None) is not None else None
    return cells is not None and cells.size > 0 and hides_only_later(call, cells)


def _whole_rows(call) -> bool:
    """The mask as given hides whole batch rows and nothing else (each row, over its heads, queries and keys, keeps every
    cell or none, some row each way): a batch row that is all padding, as an MSA's column attention folds a padded
    residue's column into the batch (AlphaFold's axial attention). The other reading only swaps which rows are empty,
    and a padding mask read the wrong way round keeps part of a row; so it is no sign of a polarity slip."""
    from maskcli.checks.context import keep

    cells = keep(call) if getattr(call, "stored", None) is not None else None
    if cells is None or not cells.size:
        return False
    rows = cells.reshape(cells.shape[0], -1)
    full, empty = rows.all(axis=1), ~rows.any(axis=1)
    return bool((full | empty).all() and full.any() and empty.any())


def _edge_padding(call) -> bool:
    """The mask as given is a key padding mask padded at either end (each batch row's queries, over its heads, keep one
    run of keys that starts at the first or ends at the last, some row keeping every key, or some queries keeping every
    key and the others the run): its reversed reading is the other end's padding, no sign of a polarity slip (a
    left-padded encoder memory). Rows of a sample of padding alone (its batch's `attention_mask` 0 throughout: a
    static batch's filler rows, checks/emptyreal.py) are left out, and so are rows that see no key at all and read only values of 0 (trace/after.py's
    `zeroed_output` "values": MusicGen's guidance rows over zeroed states) are left out of the reading."""
    import numpy as np

    from maskcli.checks.context import keep
    from maskcli.checks.emptyreal import padding_samples

    cells = keep(call) if getattr(call, "stored", None) is not None else None
    if cells is None or not cells.size:
        return False
    rows = cells.any(axis=1)  # (b, Lq, Lk)
    some_full = rows.all(axis=-1).any()  # a query keeping every key: the other reading would leave it none
    if not (rows == rows[:, :1]).all():
        rows = _but_full_rows(rows)
        if rows is None:
            return False
    kept = rows[:, 0]  # (b, Lk)
    samples = padding_samples(call)  # (rows the batch's own attention_mask calls padding throughout: emptyreal.py)
    if samples.shape[0] == kept.shape[0] and samples.any() and not samples.all():
        kept = kept[~samples]
    if call.details.get("zeroed_output") == "values":  # (rows that see no key read values that are all 0: a null
        kept = kept[kept.any(axis=1)]  # condition's, classifier-free guidance's; no padding to read either way)
        if not kept.size:
            return True
    if not (some_full or kept.all(axis=1).any()) or not kept.any(axis=1).all():
        return False
    count = kept.sum(axis=1, keepdims=True)
    columns = np.arange(kept.shape[1])[None, :]
    return bool(((columns < count) == kept).all() or ((columns >= kept.shape[1] - count) == kept).all())


def _but_full_rows(rows):
    """Rows (b, Lq, Lk) where each query either keeps every key or keeps what the batch row's other queries keep
    (mllama's cross-attention mask: a text token before any image keeps all the tiles, its output zeroed after, and the
    others keep the real tiles), as (b, Lq, Lk) with the full rows given the others' keys; None where the queries keep
    more than one other set (a causal mask's rows). The other reading would leave the full rows no key at all."""
    import numpy as np

    full = rows.all(axis=-1)  # (b, Lq)
    first = np.argmax(~full, axis=1)  # each batch row's first query not keeping every key (0 where all do)
    kept = np.take_along_axis(rows, first[:, None, None], axis=1)  # (b, 1, Lk)
    if not ((rows == kept) | full[..., None]).all():
        return None
    return np.broadcast_to(kept, rows.shape)


def group_named(g) -> list[Finding]:
    """What the recogniser made of a trace group (checks/grouped.py), where it read the cells: the nearest expression
    to a mask nothing rebuilds, another name for the same cells, and a mask that no kind names (or a raw tril/triu)
    whose other reading one does."""
    if g.structure is None:
        return []
    found = closest(g.structure) + same_as(g.structure, g.same())
    if g.structure.kind in MEANT_LATER:
        kind, named = g.flipped()
        found += polarity(g.first, kind, named, lambda: g.past, g.run)
    return found


RULES = (
    Rule("polarity", "suspicious", "call", "a mask that is a known one read the other way round (True = masked given "
         "where True = attend is read)", group_named, "named"),
    Rule("same-as", "note", "call", "a mask two expressions name alike (local(C) and document(sizes=...)): the same "
         "cells", group_named, "named"),
    Rule("closest", "note", "call", "the expression nearest a mask nothing rebuilds, and where they differ", group_named, "named"),
)
