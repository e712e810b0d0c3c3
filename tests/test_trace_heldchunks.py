"""trace/heldchunks.py: the chunk config a streaming encoder's frames hold at each attention call, read per call."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import maskcli


@dataclass
class DynChunkTrainConfig:
    chunk_size: int
    left_context_size: int | None = None


def _attend(x):
    return F.scaled_dot_product_attention(x, x, x)


def encode(x, dynchunktrain_config):
    return _attend(x)


def test_each_call_reads_the_config_its_own_frames_hold():
    x = torch.randn(1, 1, 6, 4)
    with maskcli.trace() as t:
        encode(x, DynChunkTrainConfig(4, 2))
        encode(x, DynChunkTrainConfig(4))
        encode(x, {"chunk_size": 3, "num_left_chunks": 1})
        encode(x, SimpleNamespace(chunk_size=2, left_context_frames=8))
        encode(x, {"chunk_size": -1, "num_left_chunks": 1})  # (no chunk size > 0: nothing)
        encode(x, {"chunk_size": 4})  # (no left context stated: nothing)
    held = [c.details.get("held_chunks") for c in t.calls]
    assert [(h["chunk"], h["left"], h["unit"]) if h else None for h in held] == [
        (4, 2, "chunks"), (4, None, "chunks"), (3, 1, "chunks"), (2, 8, "frames"), None, None]
    assert held[0]["said"] == ("dynchunktrain_config.left_context_size=2 beside chunk_size=4 (DynChunkTrainConfig) "
                               "in encode()")
