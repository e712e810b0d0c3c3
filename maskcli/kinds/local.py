"""Kinds that look a fixed distance back or to a fixed place: window, prefix, sink, local."""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.kinds.base import Kind, Param, Profile, column, one_interval


def _window_intervals(p, frame):
    q = column(frame.q_positions())
    return one_interval(frame, q - p["window"] + 1, q + 1)


def _window_predicate(p, frame, device):
    window = p["window"]

    def sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return sliding_window


def _window_candidates(profile: Profile):
    rows = profile.seen
    if rows.any():
        width = int((profile.q - profile.first)[rows].max()) + 1  # the widest look-back, itself included
        if width >= 1:
            yield {"window": width}


def _prefix_intervals(p, frame):
    return one_interval(frame, frame.k_start, column(np.maximum(frame.q_positions() + 1, p["prefix"])))


def _prefix_predicate(p, frame, device):
    prefix = p["prefix"]

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    return prefix_lm


def _prefix_candidates(profile: Profile):
    if profile.seen[0] and profile.last[0] > profile.q[0]:
        yield {"prefix": int(profile.last[0]) + 1}


def _sink_intervals(p, frame):
    return one_interval(frame, 0, p["sink"])


def _sink_predicate(p, frame, device):
    sink = p["sink"]

    def sink_tokens(b, h, q_idx, kv_idx):
        return (kv_idx < sink) & (q_idx >= 0)

    return sink_tokens


def _sink_candidates(profile: Profile):
    if profile.seen[0] and profile.first[0] == 0:
        yield {"sink": int(profile.last[0]) + 1}


def _local_intervals(p, frame):
    size = p["chunk_size"]
    pad = frame.left_padding().reshape(-1, 1, 1)
    q = column(frame.q_positions())
    return one_interval(frame, pad + size * np.floor_divide(q - pad, size), q + 1)


def _local_predicate(p, frame, device):
    import torch

    size = p["chunk_size"]
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
        rank=2,
        recognise=_window_candidates,
        causal=True,
    ),
    Kind(
        name="prefix",
        meaning="prefix-LM: the first P tokens see each other both ways, the rest is causal",
        keep="kv <= q or kv < P",
        params=(Param("prefix", "int", "leading tokens that see each other both ways", "--prefix", minimum=1, metavar="P"),),
        example="prefix(3)",
        intervals=_prefix_intervals,
        predicate=_prefix_predicate,
        rank=3,
        recognise=_prefix_candidates,
        check=_prefix_check,
    ),
    Kind(
        name="sink",
        meaning="attention sinks: every query sees the first S keys (with causal and a window: StreamingLLM)",
        keep="kv < S",
        params=(Param("sink", "int", "leading keys every query sees", "--sink", minimum=1, metavar="S"),),
        example="causal & (window(3) | sink(1))",
        intervals=_sink_intervals,
        predicate=_sink_predicate,
        rank=4,
        recognise=_sink_candidates,
        check=_sink_check,
    ),
    Kind(
        name="local",
        meaning="chunked attention (Llama 4): causal inside fixed chunks of C positions; with --ids, chunks start at each row's first real token",
        keep="(q - pad) // C == (kv - pad) // C and kv <= q",
        params=(Param("chunk_size", "int", "positions per chunk (attention_chunk_size)", "--chunk-size", minimum=1, metavar="C"),),
        example="local(4)",
        intervals=_local_intervals,
        predicate=_local_predicate,
        rank=5,
        recognise=_local_candidates,
        causal=True,
        frame_data=True,
    ),
)
