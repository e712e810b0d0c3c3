"""A batch row pooled at a position its own attention_mask calls padding.

An embedder pools one position of each row of its model's output: a decoder's last token, an encoder's first (and a
generative reranker reads its yes/no logits at one position per row, ms-swift#5751's `logits[:, -1]`). The
program states which positions are each row's tokens, the `attention_mask` it handed the model call; the position it
reads (trace/poolrows.py: `last_hidden_state[arange(B), index]`, `[:, -1]`, `gather(1, ...)`) is one of them or
the row's embedding is a pad token's, which the row's tokens never reached as they would run alone. Wrong there: the
index counts the other padding side (fastembed#680, Echo#24: `attention_mask.sum(1) - 1`, a right-padding length,
taken as the last position of a left-padded batch; the reverse, `[:, -1]` of a right-padded batch; `[:, 0]` of a
left-padded one). Also a reward or value head over the output read per row (torchrl#3887's end scores at the last
column of a right-padded batch), and a model handed no attention_mask whose ids and pad id state its padding (RecBole
963ea0f1: BERT4Rec's predict gathered at `item_seq_len`, one past the row's last item), and a model handed a 4-D mask
of its own, whose rows' tokens are the queries that see some key (OpenTau#524: a value head read at `[:, -1]`, a
right-padded prompt's pad slot, whose query row sees nothing). Quiet where every pooled
position is a real token of its row (either fix), on rows with no real token, and where the output is read more widely
(a slice, a mean over the mask).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def padding_pooled(run: Run) -> list:
    """Model calls whose output a row was read from at a position its attention_mask marks padding."""
    found = []
    for top in run.tops:
        if not top.pooled:
            continue
        calls = run.made_by(top)
        if not calls:
            continue
        for read in top.pooled:
            real = read["mask"]
            if read.get("source") and (real.shape[0] < 2 or not _kept_to(calls, real)):
                continue  # (padding read off the ids and a pad id: only over a batch, where the model's own attention
                # keeps to it; one row holding the id is no padded batch: hyunwoongko's target <unk> is the id 1 its
                # decoder embedding's padding_idx names)
            rows, positions = read["rows"], read["positions"]
            bad = [(int(r), int(p)) for r, p in zip(rows.tolist(), positions.tolist()) if real[r].any() and not real[r, p]]
            if not bad:
                continue
            r, p = bad[0]
            tokens = np.flatnonzero(real[r])
            side = ("left and right" if not real[r, -1] else "left") if not real[r, 0] else "right" if not real[r, -1] else "inside"
            others = f" (and row{'s' if len(bad) > 2 else ''} {', '.join(str(b[0]) for b in bad[1:])})" if len(bad) > 1 else ""
            head = read.get("head", False)  # (a value or reward head computed over the output, read per row)
            logits = read.get("what") == "logits" or head
            where = read.get("module") or top.where  # (a model call inside the outermost one: its own class)
            guess = ("the row's length taken as its last position (length - 1 is)?" if side == "right" and p == tokens[-1] + 1
                     else "length - 1, the last position of a row padded on the right, read on a batch padded on the left?"
                     if side == "left" and p == len(tokens) - 1 and p > 0 else
                     "the last column, read as if the row were unpadded (its end looked for by a pad id its batch does "
                     "not pad with?)" if side in ("right", "left and right") and p == real.shape[1] - 1 else
                     "a fixed offset from the end, landing on padding between the row's segments (a block padded "
                     "inside the row)?" if tokens[0] < p < tokens[-1] else
                     "a first-token (CLS) position taken as if the batch were padded on the right?" if p < tokens[0]
                     else "a last-token index counting the other padding side?")
            said = read.get("source") or "the attention_mask it was called with"
            found.append((calls[-1], Finding("pooled-at-padding", (
                f"batch row {r}{others} of {where}'s {'output is read' if head else 'logits are read' if logits else 'output is pooled'} at "
                f"position {p} by {read['how']}, a padding position of {said} (row {r}'s "
                f"tokens: {spans(tokens)}, padded on the {side}): the row's "
                f"{'score is a pad token' if logits else 'embedding is a pad token'}'s — {guess}"),
                expected=f"row {r} pooled at one of its tokens {spans(tokens)}",
                source=f"{read.get('said') or ('ids' if read.get('source') else 'attention_mask')} of {where}", cell=(r, p, p))))
            break
    return found


def _kept_to(calls: list, real: np.ndarray) -> bool:
    """Some self-attention call over the (B, L) tokens whose real queries see exactly the keys `real` calls real, in
    every row with a real token: the model's own mask keeps to that padding (RecBole's `item_seq != 0`); a pad id its
    attention does not mask (hyunwoongko's decoder embedding's padding_idx 1, the program's target pad 0) says nothing."""
    rows = real.any(axis=1)
    for call in calls:
        if call.shape[0] != real.shape[0] or call.shape[2] != real.shape[1] or call.shape[3] != real.shape[1]:
            continue
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, real.shape[0]):
            continue
        seen = np.broadcast_to(cells.any(axis=1), (real.shape[0], *cells.shape[2:]))  # (B, Lq, Lk)
        by_real = (seen & real[:, :, None]).any(axis=1)  # (B, Lk): keys some real query sees
        if (by_real[rows] == real[rows]).all():
            return True
    return False


RULES = (
    Rule("pooled-at-padding", "wrong", "steps", "a batch row of a model's output pooled (indexed at one position per row: "
         "last-token or first-token pooling, or its logits read so) at a position the attention_mask it was called "
         "with marks padding",
         padding_pooled),
)
