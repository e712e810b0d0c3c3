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


def test_counts_no_request_can_have_state_nothing():
    """hunt 8: key counts below the request's own new tokens (0, negative) are no statement (`request-keys-differ` said
    "states -5" of a correct program); a negative query count neither."""
    assert _read_in(types.SimpleNamespace(q_lens=[3, 2], seq_lens=[-5, -7])) is None
    assert _read_in(types.SimpleNamespace(q_lens=[3, 2], seq_lens=[0, 0])) is None
    assert _read_in(types.SimpleNamespace(q_lens=[-3, -2], seq_lens=[5, 7])) is None
    said = _read_in(types.SimpleNamespace(q_lens=[3, 2], seq_lens=[3, 9]))
    assert said["keys"][1] == [3, 9]


class _Fights:
    """A metadata object of the program's whose __dict__ is a property: raising, a list, a dict with a key no name is."""

    def __init__(self, shown):
        self.__class__ = type("Shown", (_Fights,), {"__dict__": property(shown)})


def test_an_object_whose_attributes_cannot_be_listed_states_nothing_and_raises_nothing():
    for shown in (lambda s: 1 / 0, lambda s: [("seq_lens", [5, 7])], lambda s: {5: "x", "seq_lens": [5, 7]}):
        meta = _Fights(shown)
        assert _read_in(meta) is None  # (no query lengths beside it: nothing stated, and nothing raised)
    del meta  # (this frame's variables are read too)
    state = types.SimpleNamespace(q_lens=[3, 2], seq_lens=torch.tensor([5, 7]).to_sparse())  # (no strided values)
    assert _read_in(state) is None
