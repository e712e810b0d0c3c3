"""Real tokens handed the padding row of the model's own position table.

A learned position table that keeps a row for padding (`nn.Embedding(max_positions, d, padding_idx=p)`: RoBERTa's
family, XLM-R, CamemBERT, MPNet, Longformer, LayoutLMv3, ESM, fairseq's LearnedPositionalEmbedding) states where
padding sits: row p is zero and no gradient reaches it, and the model's own numbering starts a row's real tokens at
p + 1. A program that hands the model `position_ids` of its own (a packing collator, a flattened batch) where a real
token (attention_mask 1, or an id other than the pad id where no mask was handed) sits at p gives that token the
padding's position: the numbering restarts from 0 where the model counts from p + 1
(huggingface/sentence-transformers#3879 and huggingface/transformers#47496: DataCollatorWithFlattening's 0-based
position_ids fed to XLM-R). Wrong: the program's positions contradict its model's table.

Quiet where the positions are the model's own (none handed), where transformers' generate handed them (its choice,
not the program's: trace/positionrow.py), and where no real token sits at the padding row (positions from p + 1; a
table whose padding row lies past every position used).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.checks.tokens import _pad
from maskcli.text import Finding


def _real(read: dict, arguments: dict, shape: tuple) -> tuple[np.ndarray, str] | None:
    """(bool (B, L) real tokens, words) from the attention_mask beside the positions, else their ids against the pad
    id the program states."""
    mask, ids, pad = read.get("mask"), read.get("ids"), _pad(arguments)
    if mask is not None and mask.shape[1] == shape[1] and mask.shape[0] in (1, shape[0]) and mask.min() >= 0 \
            and mask.max() <= 1:
        return np.broadcast_to(mask == 1, shape), "attention_mask 1"
    if ids is not None and ids.shape[1] == shape[1] and ids.shape[0] in (1, shape[0]) and pad is not None:
        return np.broadcast_to(ids != pad[0], shape), f"an id other than {pad[1]} {pad[0]}"
    return None


def padding_row(run: Run) -> list:
    """(call, Finding) for the first model call whose handed position_ids put a real token at its position table's
    padding row."""
    for top in run.tops:
        read = top.arguments.get("position_padding_row")
        calls = run.made_by(top) if isinstance(read, dict) else []
        if not calls:
            continue
        row, name, positions = read["row"], read["table"], read["positions"]
        rows = max(positions.shape[0], *(read[k].shape[0] for k in ("ids", "mask") if read[k] is not None))
        real = _real(read, top.arguments, (rows, positions.shape[1]))
        if real is None or positions.shape[0] not in (1, rows):
            continue
        hits = real[0] & (np.broadcast_to(positions, real[0].shape) == row)
        if not hits.any():
            continue
        b, t = (int(x) for x in np.argwhere(hits)[0])
        start = int(positions[min(b, positions.shape[0] - 1)][real[0][b]].min())
        handed = f"position_ids (in its argument `{read['held_by']}`)" if read["held_by"] else "position_ids"
        return [(calls[0], Finding("position-padding-row", (
            f"{top.where} was handed {handed} that put {int(hits.sum())} real token(s) ({real[1]}) at position {row}, "
            f"the padding row of its position table `{name}` (padding_idx={row}: a zero row no gradient reaches), "
            f"first batch row {b}, token {t}; row {b}'s real tokens start at position {start} where the model numbers "
            f"them from {row + 1} (positions restarted at 0? add padding_idx + 1, as RoBERTa's "
            f"create_position_ids_from_input_ids does)"),
            expected=f"real tokens at positions from {row + 1}", source=f"`{name}` (padding_idx={row})",
            cell=(b, t, t)))]
    return []


RULES = (
    Rule("position-padding-row", "wrong", "steps", "position_ids a program handed its model put real tokens at the "
         "padding row of the model's learned position table (RoBERTa's padding_idx: positions counted from 0, not "
         "padding_idx + 1)", padding_row),
)
