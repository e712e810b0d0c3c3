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
    row: the program states the sequence is padding whole (mlx-audio's Irodori-TTS masks an empty caption's every
    token, and its caption encoder attends over nothing real). Only a mask read 1 = real: a key_padding_mask of all
    True is as often a mask of all real tokens handed the wrong way round."""
    for held in call.details.get("held_padding") or ():
        rows = held.get("rows")
        if held.get("kind") == "keep" and isinstance(rows, np.ndarray) and rows.ndim == 2 and rows.size \
                and rows.shape[1] == call.shape[3] and rows.shape[0] in (1, call.shape[0]) and not rows.any():
            return f"{held['name']} in {held.get('where', 'a frame')}"
    return None
