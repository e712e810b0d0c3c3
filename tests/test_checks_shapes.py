"""checks/shapes.py: a mask's dimensions against what the kernels take, checked against the kernels themselves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maskcli.checks.shapes import heads

B, H, L, S = 2, 2, 3, 4


def sdpa_takes(shape) -> bool:
    """SDPA's own answer: attn_mask must broadcast to (B, H, L, S) (torch/nn/functional.py:6463, the docstring)."""
    q, k = torch.zeros(B, H, L, 8), torch.zeros(B, H, S, 8)
    try:
        F.scaled_dot_product_attention(q, k, k, attn_mask=torch.ones(shape, dtype=torch.bool))
    except RuntimeError:
        return False
    return True


def mha_takes(shape, batch: int) -> bool:
    """nn.MultiheadAttention's own answer: a 3-D attn_mask must be (batch * heads, L, S) (torch/nn/functional.py:6913)."""
    attention = torch.nn.MultiheadAttention(8, H, batch_first=True)
    try:
        attention(torch.zeros(batch, L, 8), torch.zeros(batch, S, 8), torch.zeros(batch, S, 8),
                  attn_mask=torch.zeros(shape, dtype=torch.bool))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("first", [1, 2, 3, 4])
def test_a_3d_mask_is_flagged_where_sdpa_refuses_it_or_mha_reads_it_per_batch_row(first):
    codes = [f.code for f in heads((first, L, S), H)]
    assert ("3d-shape" in codes) == (not sdpa_takes((first, L, S)))
    # one plane per head: SDPA takes it, MHA takes it for a batch of 1 and refuses it for a batch of 2
    per_head = sdpa_takes((first, L, S)) and mha_takes((first, L, S), 1) and not mha_takes((first, L, S), 2) and first > 1
    assert ("3d-heads" in codes) == per_head


@pytest.mark.parametrize("count", [1, 2, 3])
def test_a_4d_mask_whose_heads_sdpa_cannot_broadcast_is_flagged(count):
    assert ([f.code for f in heads((1, count, L, S), H)] == ["heads-mismatch"]) == (not sdpa_takes((1, count, L, S)))


def test_nothing_is_said_without_a_head_count():
    assert heads((3, L, S), None) == [] and heads((1, 3, L, S), None) == []


@pytest.mark.parametrize("first", [1, 2, 3, 4])
def test_a_tensor_a_user_gave_has_its_shape_read_through_the_registry_against_its_heads(first):
    import numpy as np

    from maskcli.inspect.analysis import analyse
    from maskcli.inspect.polarity import Convention

    # inspect's Analysis (analyse runs the registry's "tensor" rules, with the head count the user gave)
    tensor, keep = np.zeros((first, L, S), dtype=bool), Convention("keep", "values", "")
    shape = [f for f in analyse(tensor, H, keep).findings if f.code.startswith("3d")]
    assert ("3d-shape" in [f.code for f in shape]) == (not sdpa_takes((first, L, S)))
    assert [f for f in analyse(tensor, None, keep).findings if f.code.startswith("3d")] == []  # no head count: nothing said
