"""Kinds that look a fixed distance back or to a fixed place: window, lookback, prefix, sink, local."""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.kinds.base import Kind, Param, Profile
from maskcli.kinds.values import row_of
from maskcli.kinds.basic import later
from maskcli.kinds.labels import at_position, position_table, run_start, run_starts


def _window_intervals(p, frame):
    q = frame.q_column
    return q - p["window"] + 1, q + 1


def _window_predicate(p, frame, device):
    window = p["window"]

    def sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return sliding_window


def _window_why(p, frame, b, q, kv):
    w = p["window"]
    if kv > q:
        return False, later(q, kv)
    return (q - kv < w), f"{q} - {kv} = {q - kv} {'<' if q - kv < w else '>='} {w}"


def _window_candidates(profile: Profile):
    rows = profile.seen
    if rows.any():
        width = int((profile.q - profile.first)[rows].max()) + 1  # the widest look-back, itself included
        if width >= 1:
            yield {"window": width}


def _lookback_intervals(p, frame):
    return frame.q_column - p["window"] + 1, frame.k_end


def _lookback_predicate(p, frame, device):
    window = p["window"]

    def sliding_window_overlay(b, h, q_idx, kv_idx):
        return kv_idx > q_idx - window  # no kv <= q: Hugging Face's overlay, and-ed onto a causal | blocks mask

    return sliding_window_overlay


def _lookback_why(p, frame, b, q, kv):
    w = p["window"]
    edge = " (no causal edge: a later key is kept)" if kv > q else ""
    return (q - kv < w), f"{q} - {kv} = {q - kv} {'<' if q - kv < w else '>='} {w}{edge}"


def _prefix_why(p, frame, b, q, kv):
    size = p["prefix"]
    if kv < size:
        return True, f"kv {kv} < {size}: in the prefix, seen both ways"
    return (kv <= q), f"kv {kv} >= {size}, past the prefix; " + (f"kv {kv} <= q {q}" if kv <= q else later(q, kv))


def _sink_why(p, frame, b, q, kv):
    size = p["sink"]
    return (kv < size), f"kv {kv} {'<' if kv < size else '>='} {size}: {'one' if kv < size else 'not one'} of the first {size} keys"


def _prefix_intervals(p, frame):
    return frame.k_start, np.maximum(frame.q_column + 1, p["prefix"])


def _prefix_predicate(p, frame, device):
    prefix = p["prefix"]

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    return prefix_lm


def _prefix_candidates(profile: Profile):
    if profile.seen[0] and profile.last[0] > profile.q[0]:
        yield {"prefix": int(profile.last[0]) + 1}


def _sink_intervals(p, frame):
    return 0, p["sink"]


def _sink_predicate(p, frame, device):
    sink = p["sink"]

    def sink_tokens(b, h, q_idx, kv_idx):
        return (kv_idx < sink) & (q_idx >= 0)

    return sink_tokens


def _sink_candidates(profile: Profile):
    if profile.seen[0] and profile.first[0] == 0:
        yield {"sink": int(profile.last[0]) + 1}


def chunk_starts(p, frame, positions: np.ndarray) -> np.ndarray:
    """int64 (R, len(positions)): where the chunk of each position starts, per batch row.

    Chunks of C positions count from each row's first real token (Hugging Face's chunked_overlay
    with left padding) and, with documents, from each document's start: Hugging Face's packed
    sequences evaluate the chunked mask at position_ids that restart at 0 in each document.
    """
    size = p["chunk_size"]
    start = frame.left_padding().reshape(-1, 1)  # (B, 1)
    if p["documents"] is not None:
        start = np.maximum(run_starts(p["documents"].array)[:, positions], start)  # (R, L): labels cover 0..n-1
    return start + size * np.floor_divide(positions - start, size)


def _local_why(p, frame, b, q, kv):
    size = p["chunk_size"]
    first = frame.first_real(b)
    documents = row_of(p["documents"].array, b) if p["documents"] is not None else None

    def chunk(i: int) -> int:
        start = first if documents is None else max(first, run_start(documents, i))
        return start + size * ((i - start) // size)

    counted = "each document's start" if documents is not None else f"{'the first real token ' if first else 'position '}{first}"
    qc, kc = chunk(q), chunk(kv)
    where = f"chunks of {size} from {counted}: q {q} in the chunk from {qc}, kv {kv} in the chunk from {kc}"
    if qc != kc:
        return False, where
    return (kv <= q), where + ("" if kv <= q else "; " + later(q, kv))


def _local_intervals(p, frame):
    return chunk_starts(p, frame, frame.q_positions)[:, :, None], frame.q_column + 1


def _local_predicate(p, frame, device):
    import torch

    size = p["chunk_size"]
    if p["documents"] is not None:
        starts = position_table(chunk_starts(p, frame, np.arange(frame.n, dtype=np.int64)), device)

        def chunked_causal_per_document(b, h, q_idx, kv_idx):
            return (at_position(starts, b, kv_idx) == at_position(starts, b, q_idx)) & (kv_idx <= q_idx)

        return chunked_causal_per_document

    pad = torch.as_tensor(frame.left_padding(), device=device)
    if len(pad) == 1:
        pad = pad[0]  # one --ids row serves every batch row of the other terms: pad[b] is then pad
    if not bool(pad.any()):

        def chunked_causal(b, h, q_idx, kv_idx):
            return (kv_idx // size == q_idx // size) & (kv_idx <= q_idx)

        return chunked_causal

    def chunked_causal_left_padded(b, h, q_idx, kv_idx):
        start = pad if pad.dim() == 0 else pad[b]  # chunks count from each batch row's first real token (Hugging Face's chunked_overlay)
        return ((kv_idx - start) // size == (q_idx - start) // size) & (kv_idx <= q_idx)

    return chunked_causal_left_padded


def _local_candidates(profile: Profile):
    starts = np.unique(profile.first[profile.seen])
    if len(starts) >= 2:
        yield {"chunk_size": int(np.diff(starts).max())}


def _sink_check(p, frame, where):
    if p["sink"] > frame.n:
        raise MaskError(f"{where}: {p['sink']} sink tokens is more than the sequence's {frame.n} positions: use at most {frame.n}")


def _prefix_check(p, frame, where):
    if p["prefix"] > frame.n:
        raise MaskError(f"{where}: the prefix of {p['prefix']} is longer than the sequence ({frame.n} tokens): use at most {frame.n}")


KINDS = (
    Kind(
        name="window",
        meaning="sliding window: each query sees itself and the W-1 keys before it (Mistral, Gemma; W keys as Hugging Face counts)",
        keep="q - W < kv <= q",
        params=(Param("window", "int", "keys each query sees: itself and the W-1 before it (Hugging Face's count; FlashAttention window_size=(W-1, 0))", "--window", minimum=1, metavar="W"),),
        example="window(3)",
        intervals=_window_intervals,
        predicate=_window_predicate,
        why=_window_why,
        rank=2,
        recognise=_window_candidates,
        causal=True,
        sees_own=True,
    ),
    Kind(
        name="lookback",
        meaning="the sliding window without its causal edge (Hugging Face's sliding_window_overlay): keys less than W "
        "back and every later one; Gemma 3's sliding layers with images are (causal | blocks(...)) & lookback(W)",
        keep="q - W < kv",
        params=(Param("window", "int", "how far back each query sees: itself and the W-1 keys before it, as in window(W) (Hugging Face's sliding_window)", "--window", minimum=1, metavar="W"),),
        example="(causal | blocks(-1,0,0,-1)) & lookback(2)",  # 4 tokens: the command fits 60 columns
        intervals=_lookback_intervals,
        predicate=_lookback_predicate,
        why=_lookback_why,
        rank=6,  # its cells are triu(1 - W, means=keep), which inspect names: nothing more to recognise
        sees_own=True,
    ),
    Kind(
        name="prefix",
        meaning="prefix-LM: the first P tokens see each other both ways, the rest is causal",
        keep="kv <= q or kv < P",
        params=(Param("prefix", "int", "leading tokens that see each other both ways", "--prefix", minimum=1, metavar="P"),),
        example="prefix(3)",
        intervals=_prefix_intervals,
        predicate=_prefix_predicate,
        why=_prefix_why,
        rank=3,
        recognise=_prefix_candidates,
        check=_prefix_check,
        sees_own=True,
        sees_first=True,
    ),
    Kind(
        name="sink",
        meaning="attention sinks: every query sees the first S keys (with causal and a window: StreamingLLM)",
        keep="kv < S",
        params=(Param("sink", "int", "leading keys every query sees", "--sink", minimum=1, metavar="S"),),
        example="causal & (window(3) | sink(1))",
        intervals=_sink_intervals,
        predicate=_sink_predicate,
        why=_sink_why,
        rank=4,
        recognise=_sink_candidates,
        check=_sink_check,
        sees_first=True,
    ),
    Kind(
        name="local",
        meaning="chunked attention (Llama 4): causal inside chunks of C positions, which start again at each row's "
        "first real token (--ids) and at each document of the expression's document labels (packed sequences)",
        keep="kv <= q, in q's chunk: C positions from the row's first real token or the document's start",
        params=(
            Param("chunk_size", "int", "positions per chunk (attention_chunk_size)", "--chunk-size", minimum=1, metavar="C"),
            Param("documents", "labels", "a document label per position: chunks also start at each document, as Hugging "
                  "Face's packed sequences restart their positions (default: the expression's document or segment labels)",
                  "--documents", default=None, metavar="LABELS", documents=True),
        ),
        example="document(0,0,0,0,0,1,1,1) & local(2)",
        intervals=_local_intervals,
        predicate=_local_predicate,
        why=_local_why,
        rank=5,
        recognise=_local_candidates,
        sequence=lambda p: None if p["documents"] is None else p["documents"].length,
        causal=True,
        frame_data=True,
        sees_own=True,
    ),
)
