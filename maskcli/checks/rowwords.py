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


def all_padding(call, run=None) -> str | None:
    """The padding mask (1 = real) a frame holds over exactly the call's keys, where it is 0 for every token of every
    row and the same mask (its name, in the same function) marks real tokens 1 at another call of the run: the program
    states the sequence is padding whole (mlx-audio's Irodori-TTS masks an empty caption's every token, its caption
    encoder attending over nothing real, where the text and speaker encoders' `mask` holds their tokens 1). Only a mask
    read 1 = real, and only one whose 1s the run shows: a mask that is 0 everywhere says nothing of its polarity
    (PaLM-rlhf's encoder `mask = x < 0`, True for padding, applied as a keep mask: every real token hidden), and a
    key_padding_mask of all True is as often a mask of all real tokens handed the wrong way round."""
    for held in call.details.get("held_padding") or ():
        rows = held.get("rows")
        if held.get("kind") == "keep" and isinstance(rows, np.ndarray) and rows.ndim == 2 and rows.size \
                and rows.shape[1] == call.shape[3] and rows.shape[0] in (1, call.shape[0]) and not rows.any() \
                and run is not None and _ones_elsewhere(run, held):
            return f"{held['name']} in {held.get('where', 'a frame')}"
    return None


def _ones_elsewhere(run, held: dict) -> bool:
    """Some call of the run holds a keep mask of `held`'s name in the same function with a 1 in it."""
    for call in run.calls:
        for other in call.details.get("held_padding") or ():
            rows = other.get("rows")
            if other.get("kind") == "keep" and other.get("name") == held.get("name") \
                    and other.get("where") == held.get("where") and isinstance(rows, np.ndarray) and rows.any():
                return True
    return False
