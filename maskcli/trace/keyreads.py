"""What an SDPA call's own K and V state, read once a call: edge runs of keys nobody wrote (zero, or one fill value:
trace/zerokv.py, trace/fillkv.py), the keys zeroed in K alone (trace/zerokeys.py), the cache slots the step wrote its
own keys to (trace/slotwrites.py), keys of earlier calls come back scaled (trace/keyscale.py) and rows blended with
another key of the call (trace/sinkblend.py)."""

from __future__ import annotations

import torch

import maskcli.trace.keyrows as keyrows
import maskcli.trace.keyscale as keyscale
import maskcli.trace.slotwrites as slotwrites
from maskcli.trace.fillkv import edge_kv
from maskcli.trace.sinkblend import sink_blend
from maskcli.trace.zerokeys import zero_keys
from maskcli.trace.zerokv import _edges_nonzero


def key_reads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape: tuple, mask=None, is_causal: bool = False) -> dict:
    """The details of edge_kv, of zero_keys, of written and of keys_rescaled, merged."""
    try:
        edges = _edges_nonzero(k, k_shape)  # (read once for zero_kv and zero_keys: most calls end at it in both)
    except Exception:  # noqa: BLE001 - a tensor not read so: each reader tries it itself, and says nothing
        edges = None
    found = edge_kv(q, k, v, k_shape, mask, is_causal, edges)
    found = {**found, **zero_keys(k, v, k_shape, edges)} if "zero_kv" not in found else found
    wrote = slotwrites.written(q.shape[-2], k, v, k_shape)
    blended = sink_blend(keyscale.last_keys(k_shape), k, k_shape)  # (before keys_rescaled keeps this call's keys)
    return {**found, **wrote, **blended, **keyscale.keys_rescaled(k, k_shape), **keyrows.sdpa_rows(tuple(q.shape), k)}


at = keyscale.at  # (capture.py names the site of the call about to be read: keys_rescaled compares within a site)


def forget() -> None:
    """A trace ended: what the readers kept of its calls let go (slotwrites.forget, keyscale.forget)."""
    slotwrites.forget()
    keyscale.forget()
