"""trace/heldsinks.py: what a call records where its module holds learned per-head sinks and its mask has no term for
them; each case built here and read against the mask's own per-head values, computed on their own."""

from __future__ import annotations

import torch
import torch.nn as nn

from maskcli.trace.heldsinks import note

SHAPE = (2, 3, 4, 4)


class Holder(nn.Module):
    def __init__(self, sinks, **flags):
        super().__init__()
        self.sinks = None if sinks is None else nn.Parameter(torch.tensor(sinks))
        for name, value in flags.items():
            setattr(self, name, value)


def _noted(module, mask, api="sdpa", details=None, shape=SHAPE) -> dict | None:
    details = {} if details is None else details
    note(details, [nn.Identity(), module], api, shape, () if mask is None else (mask,))
    return details.get("sinks_dropped")


def _band(bias_per_head=None) -> torch.Tensor:
    """(2, 3, 4, 4) additive mask: -inf where |q - k| > 1; `bias_per_head[h]` added on key 0 where given."""
    band = (torch.arange(4)[:, None] - torch.arange(4)[None, :]).abs() > 1
    mask = torch.zeros(*SHAPE).masked_fill(band, float("-inf"))
    if bias_per_head is not None:
        mask[..., 0] += torch.tensor(bias_per_head).view(1, 3, 1)
    return mask


def test_sinks_held_and_no_term_in_the_mask_are_recorded():
    module = Holder([1.0, -2.0, 0.5])
    for mask, how in ((None, "no attn_mask"), (_band(), "adds nothing but 0"), (_band() > -1, "a bool attn_mask"),
                      (_band([0.7, 0.7, 0.7]), "the same for every head")):
        found = _noted(module, mask)
        assert found is not None and how in found["mask"], (mask, found)
        assert found["heads"] == 3 and found["values"] == [1.0, -2.0, 0.5] and found["name"] == "sinks"
    # the first kept cell of batch row 0, head 0, by a loop over the band on its own (query 0 keeps key 0)
    found = _noted(module, _band())
    kept = [(q, k) for q in range(4) for k in range(4) if abs(q - k) <= 1]
    assert (found["query"], found["key"]) == kept[0]


def test_a_mask_that_may_hold_the_sinks_is_left_alone():
    sinks = [1.0, -2.0, 0.5]
    assert _noted(Holder(sinks), _band(sinks)) is None  # the sinks on key 0, per head (MiMo's fix)
    assert _noted(Holder([0.7, 0.7, 0.7]), _band([0.7, 0.7, 0.7])) is None  # one sink for all heads: it may be that one
    assert _noted(Holder(sinks), None, details={"sink_column": 4}) is None  # a softmax with the sink column joined


def test_modules_that_state_no_sinks_in_use_are_left_alone():
    assert _noted(Holder(None), None) is None
    assert _noted(Holder([0.0, 0.0, 0.0]), None) is None  # not loaded: a 0 on a key changes nothing
    assert _noted(Holder([1.0, 2.0, 3.0], use_sink=False), None) is None  # its own flag says they are off
    assert _noted(Holder([1.0, 2.0]), None) is None  # not one per head of this call
    assert _noted(Holder([1.0, 2.0, 3.0]), None, api="softmax") is None  # the logit may be added to the scores
    assert _noted(Holder([1.0, 2.0, 3.0]), None, api="flash") is None  # a kernel's own argument, or its lse


def test_mha_reads_its_heads_on_the_first_axis_of_a_3d_mask():
    sinks = [1.0, -2.0, 0.5]
    per_head = _band(sinks).reshape(6, 4, 4)  # (B * H, Lq, Lk), as nn.MultiheadAttention takes it
    assert _noted(Holder(sinks), per_head, api="mha") is None
    assert "the same for every head" in _noted(Holder(sinks), _band([0.7] * 3)[0, 0], api="mha")["mask"]


def test_a_block_holding_sinks_beside_two_attentions_is_left_alone():
    """Sinks on a block around the attending module: read where the block holds that one attention, not where it
    holds two (a self- and a cross-attention: whose sinks they are is not stated)."""
    one = Holder([1.0, -2.0, 0.5])
    one.attn = nn.MultiheadAttention(6, 3)
    inner = one.attn
    assert _noted_in([one, inner], None) is not None
    two = Holder([1.0, -2.0, 0.5])
    two.self_attn, two.cross_attn = nn.MultiheadAttention(6, 3), nn.MultiheadAttention(6, 3)
    assert _noted_in([two, two.cross_attn], None) is None


def _noted_in(stack, mask) -> dict | None:
    details: dict = {}
    note(details, stack, "mha", SHAPE, () if mask is None else (mask,))
    return details.get("sinks_dropped")
