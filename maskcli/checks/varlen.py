"""What the mask should be where the model call was handed its documents: cu_seq_lens, cu_seqlens, seq_idx.

Padding-free batches name their documents outright. transformers' DataCollatorWithFlattening
(data/data_collator.py, return_flash_attn_kwargs / return_seq_idx) flattens a batch into one row and
gives `cu_seq_lens_q` / `cu_seq_lens_k` (and `max_length_q/k`), which every model forwards to its
attention function as FlashAttentionKwargs (modeling_flash_attention_utils.py lines 604-619): the flash
path hands them to flash_attn_varlen_func (lines 846-852), one block per document over the flattened
tokens; hybrid models take `seq_idx`, each token's document (GraniteMoeHybridFlashAttentionKwargs);
fla's layers take `cu_seqlens`. Wherever the model call was given such boundaries, no query of any layer
that call reaches may see another document's key, whichever kernel runs: SDPA and eager ignore the
kwargs and read the documents only from position_ids, and only without an attention_mask or a cache
(masking_utils.py lines 862-870), so the same batch can leak on one path and not on another.

Two sources given together must agree: cu_seq_lens and the position_ids restarts (masking_utils.py's
find_packed_sequence_indices, lines 756-758: a new document wherever the position does not go up by 1)
place the documents for different kernels, so where they differ one path is wrong.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, Top, first_cell, keep, queries
from maskcli.checks.registry import Rule
from maskcli.kinds.values import rows_text
from maskcli.text import Finding

LABELS = ("seq_idx", "segment_ids")  # each token's document; segment_ids also as a field of an argument (trace/tops.py)
CUMULATIVE = ("cu_seq_lens_q", "cu_seqlens")  # (cu_seq_lens_k is the same in self-attention: pack's q-k-differ)
SHOWN = 6  # document starts a message lists


def _cumulative(cu: np.ndarray, tokens: int) -> np.ndarray | None:
    """Int64 (tokens,): each flattened token's document from cumulative lengths; None where they do not cover exactly
    the tokens from 0 (a cu_seqlens over another tensor's tokens: pack's lengths-sum)."""
    cu = cu.reshape(-1)
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != tokens or (np.diff(cu) < 0).any():
        return None
    return np.repeat(np.arange(len(cu) - 1), np.diff(cu))


def given(top, call=None) -> list[tuple[str, np.ndarray]]:
    """(argument, int64 labels (B, L) or (1, B*L)) of each document argument the model call was given: cu_seq_lens over
    the flattened tokens, seq_idx per token (its rows the call's rows); else those the module that made `call` was
    handed (trace/packed.py's documents: cu_seqlens an encoder builds inside and gives each layer)."""
    found = []
    arguments = top.arguments
    inner = {} if call is None else call.details.get("documents") or {}
    if inner and not any(name in arguments for name in (*CUMULATIVE, *LABELS)):
        arguments = dict(arguments)
        for name, value in inner.items():
            other = inner.get("cu_seqlens_k", inner.get("cu_seqlens_kv", value))
            if name == "cu_seqlens_q" and np.array_equal(value, other):
                arguments.setdefault("cu_seqlens", value)  # (flash's names; q and k that differ: no documents)
            elif name in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k"):
                arguments.setdefault(name, value)
    rows_of = next((a for a in ("position_ids", *LABELS, "attention_mask") if a in arguments), None)
    for name in CUMULATIVE:
        cu = arguments.get(name)
        if cu is None or cu.ndim != 1:
            continue
        if name == "cu_seq_lens_q" and not np.array_equal(cu, arguments.get("cu_seq_lens_k", cu)):
            continue  # q and k differ: not self-attention documents (pack's q-k-differ says it of a batch)
        shape = arguments[rows_of].shape[-2:] if rows_of is not None and arguments[rows_of].ndim == 2 else (1, int(cu[-1]))
        labels = _cumulative(cu, shape[0] * shape[1])
        if labels is None and _unpadded(cu, arguments.get("attention_mask")):
            shape, labels = (1, int(cu[-1])), _cumulative(cu, int(cu[-1]))  # (the real tokens only, flattened)
        if labels is not None:
            found.append((name, labels.reshape(shape)))
    for name in LABELS:
        seq_idx = arguments.get(name)
        if seq_idx is not None and seq_idx.ndim == 2:
            found.append((name, seq_idx))
    return found


def _unpadded(cu: np.ndarray, mask) -> bool:
    """Whether `cu` are the unpadding of the model call's (B, L) attention_mask: one document per row, as long as the
    row's real tokens (flash_attn's unpad_input, FlexBERT's unpadded layers: the real tokens flattened, padding gone)."""
    if mask is None or mask.ndim != 2 or len(cu) != mask.shape[0] + 1:
        return False
    return bool(np.array_equal(np.diff(cu), (mask != 0).sum(axis=1)))


def starts(labels: np.ndarray) -> np.ndarray:
    """Bool (B, L): where a document begins (each row's first token, and wherever the label changes)."""
    begins = np.ones(labels.shape, dtype=bool)
    begins[:, 1:] = labels[:, 1:] != labels[:, :-1]
    return begins


def expression(labels: np.ndarray) -> str:
    """`document(sizes=[...])`: the documents of each batch row, as maskcli writes them."""
    sizes = [np.diff(np.append(np.flatnonzero(row), len(row))) for row in starts(labels)]
    return f"document(sizes=[{rows_text(sizes)}])"


def _named(name: str, top) -> str:
    if name == "segment_ids" and top.arguments.get("segments_held_by"):
        return f"segment_ids (of its {top.arguments['segments_held_by']} argument)"
    if name == "segment_ids" and top.arguments.get("segments_named"):
        return top.arguments["segments_named"]
    return "cu_seq_lens_q/k" if name == "cu_seq_lens_q" and "cu_seq_lens_k" in top.arguments else name


def _cells(call, labels: np.ndarray):
    """(keep cells (rows, Lq, Lk) over the heads, labels (rows, L), the batch row of the first, whether any of the rows
    may be the call's) where the call is the model call's self-attention over its documents' tokens: square, from
    position 0, one batch row per labels row or the rows flattened into one, or one row of them (_one_row)."""
    q_len, k_len = call.shape[2:]
    rows, length = labels.shape
    if q_len != k_len or call.stored is None:
        return None
    first, either = 0, False
    if length != k_len:  # the call's rows flattened (HF's flash path), or the call's rows are the labels' flattened
        if rows * length == call.shape[0] * k_len:
            labels = labels.reshape(call.shape[0], k_len)
        elif (one := _one_row(call, labels)) is not None:
            labels, first, either = one
        else:
            return None
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, labels.shape[0]) or call.shape[0] not in (1, labels.shape[0]):
        return None
    cells = np.broadcast_to(cells.any(axis=1), (labels.shape[0], q_len, k_len))
    return cells, labels, first, either


def _one_row(call, labels: np.ndarray):
    """(labels (rows, Lk), the first one's batch row, whether any of them may be the call's) where a one-row call over
    Lk keys attends one row of a batch of rows of Lk tokens that the documents cover flattened (a loop that attends sample
    by sample, musubi-tuner's split_attn): its row read from where its queries sit in their batch (`q[i:i + 1]`), else
    every row it may be."""
    k_len, total = call.shape[3], labels.size
    if call.shape[0] != 1 or total % k_len or total == k_len:
        return None
    rows = labels.reshape(total // k_len, k_len)
    given = call.details.get("query_tensor")  # (serial, storage offset, shape, strides, version: trace/queried.py)
    if given is not None and given[3] and given[3][0] > 0 and given[1] % given[3][0] == 0 \
            and 0 < given[1] // given[3][0] < len(rows):
        row = given[1] // given[3][0]
        return rows[row:row + 1], row, False
    if k_len in np.unique(labels.reshape(-1), return_counts=True)[1]:
        return None  # (a document of exactly the call's keys: the call may be that document alone, a varlen kernel's
        # loop over the documents, not a batch row's)
    return rows, 0, True


def _handed(run: Run) -> bool:
    """Whether any model call of the run was given documents (most runs: none, and the rules stop here)."""
    return any(name in top.arguments for top in run.tops for name in (*CUMULATIVE, *LABELS)) \
        or any("documents" in call.details for call in run.calls)


def leaks(run: Run) -> list:
    """A query that sees another document's key, the documents given to the model call by cu_seq_lens or seq_idx."""
    found, done = [], set()
    if not _handed(run):
        return found
    for call in run.calls:
        top = run.top(call)
        if top is None and "documents" in call.details:  # a plain function that attends, holding cu_seqlens itself
            top = Top(f"the function attending at {call.where}", first=call.index, end=call.index + 1)
        if top is None or call.stored is None or _parted(top, call) is not None:
            continue  # (arguments that disagree: which documents leak depends on which is right; varlen-disagree)
        for name, labels in given(top, call):
            placed = _cells(call, labels)
            if placed is None or queries(call, top)[0] != 0:
                continue
            key = (call.mask, call.shape, name, labels.tobytes())
            if key in done:
                break
            done.add(key)
            cells, labels, row, either = placed
            across = cells & (labels[:, :, None] != labels[:, None, :])
            if across.any() and (not either or across.any(axis=(1, 2)).all()):  # (a row unknown: every one it may be)
                b, q, k = first_cell(across)
                b += row
                expected = expression(labels)
                found.append((call, Finding("varlen-leak", (
                    f"{_named(name, top)} given to {top.where}: documents {expected}, but query {q} of batch row {b} "
                    f"sees key {k} of another one ({int(across.sum())} such cells)"),
                    expected=expected, source=f"{_named(name, top)} of {top.where}", cell=(b, q, k))))
            break  # one argument's documents per call (they agree, or varlen-disagree says where not)
    return found


def _restarts(positions: np.ndarray) -> np.ndarray:
    """Bool (B, L): a new document wherever the position does not go up by 1 (find_packed_sequence_indices)."""
    begins = np.ones(positions.shape, dtype=bool)
    begins[:, 1:] = np.diff(positions, axis=1) != 1
    return begins


def _parted(top, call=None) -> tuple | None:
    """(first argument, its starts, other argument, its starts) of the first two of the model call's document arguments
    (cu_seq_lens, seq_idx, position_ids restarts; the cu_seqlens the module that made `call` was handed, where the
    model call holds none: nanotron#341's, built of the 2-D position_ids' row indices) that place the documents
    differently; None where they agree."""
    inner = call if call is not None and "attention_mask" not in top.arguments else None  # (a flash path's own
    # cu_seqlens, unpadded from the mask handed: documents-leak says it against the position_ids, trl#3673)
    sources = [(name, starts(labels)) for name, labels in given(top, inner)]
    positions = top.arguments.get("position_ids")
    real = top.arguments.get("attention_mask")
    if sources and positions is not None and positions.ndim == 2 and (real is None or real.min() > 0):
        sources.append(("position_ids", _restarts(positions)))
    for name, begins in sources[1:]:
        if begins.size == sources[0][1].size and (begins.reshape(sources[0][1].shape) != sources[0][1]).any():
            return (*sources[0], name, begins.reshape(sources[0][1].shape))
    return None


def disagree(run: Run) -> list:
    """Two arguments of one model call that place its documents differently: cu_seq_lens, seq_idx, position_ids."""
    found, done, tops = [], set(), set()
    if not _handed(run):
        return found
    for call in run.calls:
        top = run.top(call)
        if top is None or call.stored is None:
            continue
        documents = call.details.get("documents")  # (a module's own cu_seqlens: each distinct set read once)
        key = (id(top), None if documents is None else tuple((n, v.tobytes()) for n, v in documents.items()))
        if key in done or documents is None and id(top) in tops:
            continue
        done.add(key)
        tops.add(id(top))
        parted = _parted(top, call)
        if parted is None:
            continue
        first_name, first, name, begins = parted
        b, t = first_cell(begins != first)
        said = {n: np.flatnonzero(s[b])[:SHOWN].tolist() for n, s in ((first_name, first), (name, begins))}
        found.append((call, Finding("varlen-disagree", (
            f"{first_name} and {name} given to {top.where} place the documents differently: batch row {b} starts "
            f"documents at {said[first_name]} by {first_name}, at {said[name]} by {name} (first at token {t}): the "
            f"kernels that read one see other documents than those that read the other"),
            expected=f"documents starting at {said[first_name]}", source=f"{first_name} of {top.where}", cell=(b, t, t))))
    return found


RULES = (
    Rule("varlen-leak", "wrong", "steps", "documents the model call was given by cu_seq_lens, cu_seqlens or seq_idx "
         "(padding-free batches) whose mask lets a query see another document", leaks),
    Rule("varlen-disagree", "wrong", "steps", "cu_seq_lens, seq_idx and position_ids of one model call that place its "
         "documents differently", disagree),
)
