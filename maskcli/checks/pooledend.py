"""A causal model's output pooled before a row's end, where the same read lands on the end of other rows; and every
row read at its length less one on a batch padded on the left.

Under causal attention a position's output has seen only the tokens up to it: a decoder's embedding, a CLIP text
tower's EOS feature, is read at each row's last token (trace/poolrows.py records the position each row is read at,
with the model call's padding). One read (one index per row) that lands on the last real token of some rows and on an
earlier real token of others reads the others' features from a prefix: the index meant each row's end and missed it
there (transformers#24777: CLIP pooled at `input_ids.argmax(-1)`, the EOS while it had the largest id; a token added
for textual inversion outranks it, and the rows holding it were pooled at that token, which never sees the rest of
the prompt). Wrong where the model call's self-attention over its tokens is causal (every real query sees exactly the
real keys up to itself) at every call over them.

Quiet where every row is read at its end (either fix), where no row is (a reader of another position: a prompt's last
token before the response that follows it, a first-token read), on a model that attends both ways (a position there
sees every token), and on logits or a head computed over the output (a reranker's or a reward head's own position).

The length-less-one read is said of any model and of a head too: where every row read (two or more) is read at its own
count of real tokens less one, and a row padded on the left is read before its last token, the index is the last
position of a row padded on the right, counted on a batch padded on the left (minimind 9c98cab / d7f4f4e's PPO critic,
written blind, blind-zf: its value read at `full_mask.sum(1) - 1`; the fix reads `(full_mask * arange).argmax(1)`).
A row read at padding that way is pooled-at-padding's (checks/pooledat.py).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def pooled_before_end(run: Run) -> list:
    """Model calls whose output one read pools at some rows' last real token and before it on other rows, causal."""
    found = []
    for top in run.tops:
        for read in top.pooled or ():
            real = read["mask"]
            pairs = list(zip(read["rows"].tolist(), read["positions"].tolist()))
            shorter = _length_less_one(real, pairs)
            if shorter is not None and (made := run.made_by(top)):
                found.append((made[-1], _length_finding(read, top, real, *shorter)))
                break
            if read.get("head") or read.get("what") == "logits":
                continue  # (a score or a reranker's logits: their position is the program's own choice)
            ends = {r: int(np.flatnonzero(real[r])[-1]) for r, _ in pairs if real[r].any()}
            early = [(r, p) for r, p in pairs if r in ends and real[r, p] and p < ends[r]]
            at_end = [r for r, p in pairs if ends.get(r) == p]
            calls = run.made_by(top)
            if not early or not at_end or not _causal(calls, real):
                continue
            (r, p), e = early[0], at_end[0]
            tokens = np.flatnonzero(real[r])
            where = read.get("module") or top.where
            ids = top.arguments.get("input_ids")
            largest = isinstance(ids, np.ndarray) and ids.shape == real.shape and all(
                int(np.argmax(ids[row])) == at for row, at in pairs)
            guess = ("each row read at its largest id, the EOS only while no token added later outranks it"
                     if largest else "an index that meant each row's end")
            others = f" (and row{'s' if len(early) > 2 else ''} {', '.join(str(b) for b, _ in early[1:])})" \
                if len(early) > 1 else ""
            found.append((calls[-1], Finding("pooled-before-end", (
                f"batch row {r}{others} of {where}'s output is pooled at position {p} by {read['how']}, a token before "
                f"the row's last (its tokens: {spans(tokens)}), while batch row {e} is pooled at its last token "
                f"({ends[e]}): its attention is causal, so row {r}'s pooled feature never saw tokens "
                f"{spans(tokens[tokens > p])} — {guess}?"),
                expected=f"row {r} pooled at its last token {int(tokens[-1])}", source=f"attention_mask of {where}",
                cell=(r, p, p))))
            break
    return found


def _length_less_one(real: np.ndarray, pairs: list) -> tuple[int, int] | None:
    """(row, position) of the first row padded on the left that is read at its length less one, a real token before
    its last, where every row read (two or more, each with a token) is read at its own length less one; else None."""
    counts = real.sum(axis=1)
    if len(pairs) < 2 or any(not counts[r] or p != counts[r] - 1 for r, p in pairs):
        return None
    return next(((r, p) for r, p in pairs if not real[r, 0] and p != np.flatnonzero(real[r])[-1]), None)


def _length_finding(read: dict, top, real: np.ndarray, r: int, p: int) -> Finding:
    tokens = np.flatnonzero(real[r])
    where, head = read.get("module") or top.where, read.get("head") or read.get("what") == "logits"
    return Finding("pooled-before-end", (
        f"batch row {r} of {where}'s {'output is read' if head else 'output is pooled'} at position {p} by "
        f"{read['how']}, its length less one ({len(tokens)} tokens: {spans(tokens)}, padded on the left), a token "
        f"before its last ({int(tokens[-1])}), as every row read is at its length less one — the last position of a "
        f"row padded on the right, read on a batch padded on the left?"), expected=f"row {r} read at {int(tokens[-1])}",
        source=f"{read.get('source') or 'attention_mask'} of {where}", cell=(r, p, p))


def _causal(calls: list, real: np.ndarray) -> bool:
    """Some self-attention call over the (B, L) tokens (or B x H rows, the heads folded in), and every one of them causal
    on its real queries and keys."""
    rows, length = real.shape
    judged = real[:, :, None] & real[:, None, :]
    later = np.arange(length)[None, None, :] > np.arange(length)[None, :, None]
    some = False
    for call in calls:
        if call.shape[0] % rows or call.shape[2] != length or call.shape[3] != length:
            continue
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, call.shape[0]):
            return False
        if cells.shape[0] == call.shape[0] != rows:  # (heads folded into the batch, batch first: CLIP's bsz * heads)
            cells = cells.reshape(rows, -1, length, length)
        seen = np.broadcast_to(cells.any(axis=1), (rows, length, length))
        if ((seen & judged) != (judged & ~later)).any():
            return False
        some = True
    return some


RULES = (
    Rule("pooled-before-end", "wrong", "steps", "one read of a causal model's output (an index per row) lands on some "
         "rows' last real token and before it on others: those rows' pooled features saw a prefix only (CLIP's EOS "
         "looked up as the largest id)", pooled_before_end),
)
