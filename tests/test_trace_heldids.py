"""trace/heldids.py: token ids a model call is handed inside a batch dict, with the pad id its embeddings agree on."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from maskcli.trace.heldids import held_ids


class Model(nn.Module):
    def __init__(self, pads=(None, 0)):
        super().__init__()
        self.user = nn.Embedding(10, 4, padding_idx=pads[0])
        self.item = nn.Embedding(10, 4, padding_idx=pads[1])


def test_the_dict_fields_of_ids_with_the_one_padding_idx_stated():
    hist = torch.tensor([[3, 4, 5], [3, 0, 0]])
    given = {"x": {"user_id": torch.tensor([1, 2]), "hist_item": hist, "hist_cate": (hist > 0).long() * 2,
                   "hist_len": torch.tensor([[3], [1]]), "score": torch.rand(2)}}
    where, ids, pad_id = held_ids(given, Model(), {})["held_ids"]
    assert where == 'x["hist_item"], x["hist_cate"]' and pad_id == 0
    assert np.array_equal(ids, hist.numpy())


def test_nothing_where_ids_are_named_the_embeddings_disagree_or_the_fields_pad_differently():
    hist = torch.tensor([[3, 4, 5], [3, 0, 0]])
    assert held_ids({"x": {"seq": hist}}, Model(), {"input_ids": hist.numpy()}) == {}
    assert held_ids({"x": {"seq": hist}}, Model(pads=(1, 0)), {}) == {}
    assert held_ids({"x": {"seq": hist}}, Model(pads=(None, None)), {}) == {}
    assert held_ids({"x": {"seq": hist, "other": torch.tensor([[3, 4, 0], [3, 0, 0]])}}, Model(), {}) == {}
    assert held_ids({"x": {"seq_mask": hist}}, Model(), {}) == {}  # (a mask, by its name)
    assert held_ids({"x": {"seq": torch.tensor([[1, 1, 1], [1, 0, 0]])}}, Model(), {}) == {}  # (0/1: a mask)


def test_the_ids_of_a_dict_of_dicts_one_per_indexer():
    """AllenNLP's TextFieldTensors: the ids one dict level inside the batch dict, its mask field left out by name."""
    ids = torch.tensor([[3, 4, 5], [3, 0, 0]])
    given = {"text": {"bert": {"token_ids": ids, "mask": (ids != 0).long()}}}
    where, held, pad_id = held_ids(given, Model(), {})["held_ids"]
    assert where == 'text["bert"]["token_ids"]' and pad_id == 0 and np.array_equal(held, ids.numpy())
    assert held_ids({"text": {"bert": {"token_ids": ids, "offsets": torch.tensor([[3, 4, 0], [3, 0, 0]])}}},
                    Model(), {}) == {}  # (two fields padded differently: no reading)
