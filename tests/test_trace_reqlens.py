"""trace/reqlens.py: the per-request lengths an engine's metadata object states, read from the program's frames."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch

from maskcli.trace.reqlens import lengths
from maskcli.trace.walk import walk


@dataclass
class Metadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


def _read_in(meta):
    """lengths() at a frame that holds `meta` as its own, called from the test's (whose variables are read too)."""
    return lengths(walk(sys._getframe()).held)


def test_cumulative_queries_beside_per_request_keys():
    said = _read_in(Metadata(torch.tensor([0, 3, 8]), torch.tensor([11, 5])))
    assert said["queries"][1] == [3, 5] and said["keys"][1] == [11, 5]
    assert said["keys"][0].startswith("meta.seq_lens (Metadata") and said["window"] is None


def test_a_nested_object_and_per_token_lengths_of_another_count():
    """LightLLM's state: its own cu_seqlens_q and b_att_seq_len, and infer_state.b_seq_len one per token (left out)."""
    state = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 3, 6]), b_att_seq_len=torch.tensor([7, 10]),
                                  infer_state=types.SimpleNamespace(b_seq_len=torch.arange(5, 11)))
    said = _read_in(state)
    assert said["keys"][1] == [7, 10] and said["besides"] == []


def test_key_statements_that_disagree_state_nothing():
    state = types.SimpleNamespace(cu_seqlens_q=[0, 3, 6], b_att_seq_len=[7, 10], kv_lens=[7, 9])
    assert _read_in(state) is None


def test_nothing_without_query_lengths_and_a_window_is_kept():
    assert _read_in(types.SimpleNamespace(seq_lens=[7, 10])) is None
    layer = types.SimpleNamespace(sliding_window=4)
    said = _read_in(Metadata(torch.tensor([0, 1, 2]), torch.tensor([12, 9])))  # (layer: the test's own)
    assert said["window"].startswith("layer.sliding_window=4")
