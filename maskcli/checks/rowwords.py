"""What a program states that tells the rows rules (checks/rows.py) its keys are no sequence to judge: an engine's pool
of cache slots (sees-later), a sequence that is padding whole (fully-masked)."""

from __future__ import annotations

import numpy as np


def pooled_keys(call) -> bool:
    """The engine's metadata at the call states each request's new tokens and keys (trace/reqlens.py), its new tokens
    are the call's queries, and its keys, laid one request after another, are not the call's key axis: the keys are a
    pool of cache slots (vLLM's flex backend hands every page of its KV cache, its mask_mod mapping physical slots to
    each request's positions), so no query has a position among those columns."""
    said = call.details.get("request_lengths")
    if not isinstance(said, dict) or call.shape[0] != 1:
        return False
    queries, keys = said.get("queries"), said.get("keys")
    if not queries or not keys:
        return False
    return sum(queries[1]) == call.shape[2] and sum(keys[1]) != call.shape[3]


def all_padding(call) -> str | None:
    """The padding mask (1 = real) a frame holds over exactly the call's keys, where it is 0 for every token of every
    row and the token ids the same frame holds over those keys are one id at every position but each row's first (a
    BOS before it): the program states the sequence is padding whole, and its tokens are padding (mlx-audio's
    Irodori-TTS masks an empty caption, a BOS then pad ids, and its caption encoder attends over nothing real). Only a
    mask read 1 = real, and only one its ids bear out: a mask 0 everywhere says nothing of its polarity alone
    (PaLM-rlhf's encoder `mask = x < 0`, True for padding, applied as a keep mask over real ids; MiDashengLM's audio
    mask turned round), and a key_padding_mask of all True is as often a mask of all real tokens handed the wrong way
    round."""
    held = call.details.get("held_padding") or ()
    for mask in held:
        rows = mask.get("rows")
        if mask.get("kind") == "keep" and isinstance(rows, np.ndarray) and rows.ndim == 2 and rows.size \
                and rows.shape[1] == call.shape[3] and rows.shape[0] in (1, call.shape[0]) and not rows.any() \
                and any(_padding_ids(ids, rows.shape) for ids in held if ids.get("where") == mask.get("where")):
            return f"{mask['name']} in {mask.get('where', 'a frame')}"
    return None


def _padding_ids(held: dict, shape: tuple) -> bool:
    """Token ids a frame holds, of `shape`, one id at every position after each row's first."""
    ids = held.get("rows")
    return held.get("kind") == "ids" and isinstance(ids, np.ndarray) and ids.shape == shape and shape[1] > 2 \
        and bool((ids[:, 1:] == ids[0, -1]).all())
