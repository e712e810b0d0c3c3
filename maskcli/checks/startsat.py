"""Where a model call's sequences start, in the positions it states (positions-vs-keys, checks/positioned.py).

A prefill's query that starts a sequence (it sees only itself, and the next query sees it and itself) sits at the
first position of that sequence, wherever its row's padding or an earlier packed sample put it: two starts of one
call placed apart embed the same tokens two ways. Read where the program left its model to number the tokens by
column (the model takes position_ids and was handed none), or where it numbered each row itself (positions that differ
from row to row). The positions are the ones the call states, or those its one table of absolute positions was read
at (trace/tables.py's `table_positions`: x-transformers' AbsolutePositionalEmbedding counts them in a forward whose
frame is gone before attention runs).
"""

from __future__ import annotations

import numpy as np

from maskcli.text import Finding


def looked_up(top) -> tuple[str, np.ndarray, bool] | None:
    """(its name, int64 (rows, L), False) of the rows a model call's one table of absolute positions was read at
    (trace/tables.py: x-transformers' AbsolutePositionalEmbedding counts them in its own forward, gone before any
    attention runs; BART's offset of 2 left in), or None."""
    read = top.arguments.get("table_positions")
    if not isinstance(read, np.ndarray) or read.ndim != 2 or not read.size or read.dtype.kind not in "iu":
        return None
    return "the rows its table of positions was read at", read.astype(np.int64), False


def starts(call, seen, placed, placed_at, source: str, unhanded: bool, absolute: bool = False,
           earlier: dict | None = None) -> Finding | None:
    """A prefill's queries that start a sequence (each sees only itself, and the query after it sees it and itself)
    must sit at one position, wherever their row's padding or earlier packed samples put them: with positions looked up
    in a table, the same text is embedded differently by where its batch put it (OpenRLHF#217's left-padded rows
    scored without position_ids; LlamaFactory#7318's packed samples numbered on from the sample before). Asked only
    where the model takes positions and the program's call handed it none (trace/positionsat.py's unhanded): a forward
    that takes none numbers its columns by its own statement (a hand-written GPT's `arange`), and a library's
    generation loop that hands none (BART's, Whisper's decoder prompts) is the library's numbering, not the program's;
    or where the positions differ from row to row: the program placed each row's tokens itself, so one row's first
    start placed apart from another's contradicts its own numbering; or where the call was handed positions alike for
    every row that the model looks up in a table of absolute positions (`absolute`): a left-padded row numbered by
    column reads other rows of the table than the same text unpadded (unsloth#4100: position_ids from the shared
    cache_position; the model's own numbering, handed none, stays its statement) (x-transformers 013e60a added each left-padded
    row's pad count to its positions where it meant to take it off); a later start in a row is a chunk's (Llama 4's
    chunked layers) or a packed sample's, not compared. Where the model numbered the columns itself (`unhanded`), a
    start is compared with the first start of the site's earlier calls too (`earlier`, by call site): a batch of one
    row windowed over a left-padded history (the Decision Transformer's get_action, transformers#17946) puts each
    call's one start as far on as its padding is long."""
    batch, _, q_len, k_len = call.shape
    if q_len != k_len or q_len < 2:
        return None
    counts = seen.sum(axis=2)
    follows = np.zeros_like(placed)
    follows[:, :-1] = placed[:, 1:] & (counts[:, 1:] == 2) & seen[:, np.arange(1, q_len), np.arange(q_len - 1)]
    starts = np.argwhere(placed & (counts == 1) & follows)
    numbered = True
    if not unhanded:  # (rows numbered apart: some column real in two rows at two positions, not a numbering of the
        both = placed[:, None, :] & placed[None, :, :]  # columns with the pads zeroed, SASRec's; then each row's
        numbered = (both & (placed_at[:, None, :] != placed_at[None, :, :])).any()  # first start alone, its
        if not numbered and not absolute:  # sequence's; a later one in the row
            return None  # (`absolute`: positions handed alike for every row, each looked up in a table of absolute
            # positions: a row's start placed by its padding is other text, unsloth#4100's cache_position)
        starts = starts[np.r_[True, starts[1:, 0] != starts[:-1, 0]]] if len(starts) else starts  # is a chunk's,
        # Llama 4's chunked layers, or a packed sample's, numbered on by its row's own statement)
    if not len(starts):
        return None
    at = placed_at[starts[:, 0], starts[:, 1]]
    ours = (call.index, int(starts[0][0]), int(starts[0][1]), int(at[0]))
    first = earlier.setdefault(call.where, ours) if earlier is not None and unhanded else None
    if at.min() == at.max():  # (this call's starts at one place: held against the site's first, in an earlier call)
        if first is None or first[3] == ours[3]:
            return None
        (c, b, j, p), (c0, b0, j0, p0) = (ours, first) if ours[3] > first[3] else (first, ours)
        row, where = f"call {c}'s batch row {b}", f"call {c0}'s batch row {b0}"
    else:
        (b0, j0), (b, j) = starts[int(np.argmin(at))], starts[int(np.argmax(at))]
        p0, p = int(at.min()), int(at.max())
        row, where = f"batch row {b}", f"batch row {b0}"
    return Finding("positions-vs-keys", (
        f"{row}: query {j} starts a sequence (it sees only itself, and the next query sees it) at position {p}, "
        f"where {where}'s query {j0} starts one at {p0}: looked up in a table of positions, the same tokens are "
        f"embedded by where the batch put them, counting {p - p0} tokens before them they do not see (left padding or "
        f"an earlier packed sample): " + ("the model takes position_ids and the call handed none" if unhanded else
                                          "the program numbers each row itself, and puts these starts apart" if
                                          numbered else "the positions handed number every row's columns alike, its "
                                          "padding counted (positions from a shared cache_position or arange?)")),
        expected=f"position {p0}", source=source,
        cell=(int(b), int(j), int(j)))
