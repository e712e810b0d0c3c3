"""maskcli.trace.later: a model call handed only plain values and small integer tensors has its Top made once the run
is over, from the arguments as they were when the call ended (the program changes its own after); one handed a float
input has it made as the call ends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import maskcli


class Tiny(nn.Module):
    def forward(self, input_ids, attention_mask, features=None):
        q = torch.ones(input_ids.shape[0], 1, input_ids.shape[1], 4)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=attention_mask.bool()[:, None, None, :])


def test_a_top_made_after_the_run_holds_the_mask_as_the_call_was_handed_it():
    model, ids, mask = Tiny(), torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 1, 1, 1]])
    handed = []
    with maskcli.trace() as t:
        for step in range(3):
            handed.append([int(x) for x in mask[0]])  # (the reference: the cells as the call is handed them)
            model(ids, mask)
            mask[0, 3 - step] = 0  # the program changes its mask in place once the call is over
        waiting = [type(top).__name__ for top in t._tops]
    # (the first call is finished as the second begins, its module's hooks put on during it: outer.py keeps what it
    # was handed as it was, the program having changed it since)
    assert waiting == ["Later", "Later", "Later"]
    assert [top.arguments["attention_mask"].tolist() for top in t.tops] == [[row] for row in handed]
    assert [top.arguments["input_ids"].tolist() for top in t.tops] == [[[5, 6, 7, 8]]] * 3
    assert [(top.first, top.end) for top in t.tops] == [(0, 1), (1, 2), (2, 3)]


def test_a_first_call_changed_in_place_after_it_is_read_as_handed_also_under_inference_mode():
    """The module's first call ends without a hook (its hooks are put on during it): finished once the run is over, it
    holds the mask as handed, not as the program left it (GritLM zeroes its instruction tokens for its pooling)."""
    for mode in (torch.no_grad, torch.inference_mode):
        model, ids = Tiny(), torch.tensor([[5, 6, 7, 8], [5, 6, 7, 0]])
        with mode():
            mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
            with maskcli.trace() as t:
                model(ids, mask)
                mask[:, :2] = 0  # (after the call: the pooling's mask, not the attention's)
        assert t.tops[0].arguments["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]], mode

    class FixedInside(Tiny):  # (the forward itself changes its mask after attending: read as the call returned)
        def forward(self, input_ids, attention_mask, features=None):
            out = super().forward(input_ids, attention_mask)
            attention_mask[:, -1] = 1
            return out

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with maskcli.trace() as t:
        FixedInside()(torch.tensor([[5, 6, 7], [5, 6, 7]]), mask)
        mask.zero_()  # (after the call: not the call's)
    assert t.tops[0].arguments["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 1]]


def test_a_call_handed_a_float_input_has_its_top_made_as_it_ends():
    model, ids, mask = Tiny(), torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 0]])
    with maskcli.trace() as t:
        for _ in range(2):
            model(ids, mask, features=torch.zeros(1, 3))
        waiting = [type(top).__name__ for top in t._tops]
    assert waiting == ["Top", "Top"]
    assert [top.arguments["attention_mask"].tolist() for top in t.tops] == [[[1, 1, 0]]] * 2
