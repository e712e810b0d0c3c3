"""Which of the paddings a call's frames hold are of its keys (checks/held.py's padding-unused reads these).

- A bool mask over the cells handed down as `mask` / `attn_mask` / `attention_mask` (B, Lq, Lk), whose query rows are
  one key row each batch row repeats (a key padding mask expanded over the queries: `pad.unsqueeze(1).expand(b, l, l)`),
  held where the call's site masks nowhere (a square softmax over no mask at all): its key row is the batch's padding
  where one way round of it is a padded batch (each row one run of real tokens at one edge, every row with a real
  token, one row whole; checks/held.py `readings`) and the other is not (a row all padding): the way round is the
  batch's own (Practical_NLP_in_PyTorch#8: the expanded pad mask reached the attention head, never its
  ScaledDotProductAttention). Where the site masks somewhere, such a mask is heldcells.py's (either way round).
- A padding that a cross-attention of the same block keeps to exactly, over the same queries (checks/context.py
  `beside_memory`), is the memory's: it says nothing of a self-attention's keys, and is left out of its readings, so
  that the target's own padding held beside it is still read (OpenNMT-py#1044: a decoder layer holds `src_pad_mask` and
  `tgt_pad_mask`, its self-attention's mask thrown away).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, _block, beside_memory, cross

_KEYS: dict = {}  # id of a held cells mask -> (that held, its key padding read, or None): read once while held


def keys_of(run: Run, call, unmasked: list, readings) -> list | None:
    """The paddings `call`'s frames hold that may be of its keys: those it holds, a key mask expanded over the cells read
    as the padding it is (where `call` is one of `unmasked`, square softmaxes whose site masks nowhere), and no padding
    the block's cross-attention keeps to (where `call` is a self-attention); None where it holds none. `readings`:
    checks/held.py's, each way a held padding reads over the keys (handed in: held.py is this module's caller)."""
    helds = call.details.get("held_padding")
    if not helds:
        return helds
    rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
    ids = tuple(h["rows"] for h in helds if h["kind"] == "ids")
    if any(call is one for one in unmasked):
        helds = [_as_keys(h, ids, k_len, readings) if h["kind"] == "cells" else h for h in helds]
        helds = [h for h in helds if h is not None]
    if q_len < k_len:  # (a step behind its cache: a prompt's padding held, as wide as the site's prefill, is its first
        # keys'; one a script's top level holds only where it is so: a batch's mask tokenized beside generate's call)
        tops = [_over_cache(run, call, h) for h in call.details.get("held_top") or ()]
        helds = [_over_cache(run, call, h) for h in helds] + [read for read in tops if read.get("over_cache")]
    if run.cross and not cross(call) and q_len >= k_len:
        # (the answer is the same for every call of one block, model call and shape over the same held arrays: once a run)
        known = run.__dict__.setdefault("_memory_helds", {})
        key = (id(run.top(call)), _block(call.where), call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in known:
            known[key] = [h for h in helds
                          if not any(beside_memory(run, call, real) for real in readings(h, rows, k_len, ids))]
        helds = known[key]
    return helds


def _as_keys(held: dict, ids: tuple, length: int, readings) -> dict | None:
    """`held` (kind cells) as the padding of its keys, kind "pad" (True = padding) or "keep" (True = real), where its
    query rows repeat one key row each batch row and exactly one way round of that row is a padded batch; else None."""
    found = _KEYS.get(id(held["rows"]))
    if found is not None and found[0] is held:
        return found[1]
    read = None
    table = held["rows"]
    if table.ndim == 3 and table.shape[-1] == length and table.shape[0] > 1 and table.shape[1] > 1 \
            and (table == table[:, :1, :]).all():
        row = table[:, 0, :]
        ways = [{**held, "kind": kind, "rows": row} for kind in ("keep", "pad")]
        ways = [way for way in ways if readings(way, row.shape[0], length, ids)]
        read = ways[0] if len(ways) == 1 else None
    if len(_KEYS) > 256:
        _KEYS.pop(next(iter(_KEYS)))
    _KEYS[id(held["rows"])] = (held, read)  # (the held dict kept: its rows' id stays its own while here)
    return read


def _over_cache(run: Run, call, held: dict) -> dict:
    """`held`, a (B, Lp) padding mask of a prompt, laid over the first Lp keys of a step behind its cache (the keys after
    them the tokens generated since, real), where the call's site first ran a prefill of exactly Lp queries and keys
    over as many rows, and held the same mask (Donut's batched prompts right-padded, the decoder's mask rebuilt all
    ones: each generated token attends the prompt's pads); else `held` as it is."""
    table, rows, k_len = held["rows"], call.shape[0], call.shape[3]
    if held["kind"] not in ("keep", "pad") or table.ndim != 2 or table.shape[0] != rows or not 1 < table.shape[1] < k_len:
        return held
    site = run.sites().get(call.where) or [call]  # (in step order: its first call, the prefill where there is one)
    first = site[0] if site[0].index < call.index else None
    if first is None or first.shape[0] != rows or first.shape[2] != first.shape[3] or first.shape[3] != table.shape[1] \
            or call.shape[2] == table.shape[1]:  # (as many queries as the mask's tokens: the call's own, after a memory
        return held  # of earlier segments, Compressive Transformer's: not a prompt's behind the steps generated since)
    if not any(one.get("name") == held.get("name") and np.shape(one.get("rows")) == table.shape
               and np.array_equal(one["rows"], table)
               for one in [*(first.details.get("held_padding") or ()), *(first.details.get("held_top") or ())]):
        return held  # (not the mask the prefill was run with: a generate loop's mask grown by the tokens since, as wide
        # as the prefill by chance, PEFT's prompt tuning behind 4 virtual tokens: its tokens are the last keys')
    after = np.full((rows, k_len - table.shape[1]), held["kind"] == "keep")
    return {**held, "rows": np.concatenate([table, after], axis=1), "over_cache": table.shape[1]}
