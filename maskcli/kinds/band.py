"""band: the symmetric (bidirectional) sliding window, each query seeing the W-1 keys on either side and itself.

Bidirectional encoders with local attention use it: ModernBERT's window_size=(W-1, W-1) on its local layers,
EmbeddingGemma's sliding layers (transformers' sliding_window_bidirectional_overlay keeps |q - kv| <= S, which is
band(S + 1)). band(W) & causal is window(W): W counts as window counts, the query itself included.
"""

from __future__ import annotations

from maskcli.kinds.base import Kind, Param, Profile


def _band_intervals(p, frame):
    q = frame.q_column
    return q - p["window"] + 1, q + p["window"]


def _band_predicate(p, frame, device):
    window = p["window"]

    def bidirectional_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < window) & (kv_idx - q_idx < window)

    return bidirectional_window


def _band_why(p, frame, b, q, kv):
    w, distance = p["window"], abs(q - kv)
    return distance < w, f"|{q} - {kv}| = {distance} {'<' if distance < w else '>='} {w}"


def _band_candidates(profile: Profile):
    rows = profile.seen
    if rows.any():
        ahead = int((profile.last - profile.q)[rows].max())  # the farthest later key, a band's W - 1
        if ahead >= 1:
            yield {"window": ahead + 1}


KINDS = (
    Kind(
        name="band",
        meaning="the bidirectional sliding window: each query sees itself and the W-1 keys on either side (ModernBERT's "
        "local layers, EmbeddingGemma); band(W) & causal is window(W)",
        keep="|q - kv| < W",
        params=(Param("window", "int", "keys each query sees on either side, itself included (band(W) & causal is "
                      "window(W))", "--window", minimum=1, metavar="W"),),
        example="band(2)",
        intervals=_band_intervals,
        predicate=_band_predicate,
        why=_band_why,
        rank=7,
        recognise=_band_candidates,
        sees_own=True,
    ),
)
