"""checks/fills.py: fills that overflow in float16/bfloat16 (against torch's own cast), an int mask whose 1s mask, and
what a trace recorded about a call's scores."""

from __future__ import annotations

import pytest
import torch

from maskcli.checks.fills import bias, fills, ones_masked, score_mod, sentinel_overflow
from maskcli.inspect.polarity import Convention


@pytest.mark.parametrize("sentinel", [-1e4, -65504.0, -1e9, torch.finfo(torch.float32).min, -1e38])
@pytest.mark.parametrize("stored", ["float32", "float64"])
def test_a_fill_is_flagged_exactly_where_torch_casts_it_to_minus_inf(sentinel, stored):
    expected = [name for name in ("float16", "bfloat16")
                if torch.tensor(sentinel, dtype=torch.float64).to(getattr(torch, name)).item() == float("-inf")]
    found = sentinel_overflow(stored, sentinel)
    assert [f.code for f in found] == ["sentinel-overflow"] * len(expected)
    assert [name for name in ("float16", "bfloat16") if any(f"does not fit {name} " in f.message for f in found)] == expected


def test_the_tensors_own_dtype_is_not_asked_and_minus_inf_needs_no_check():
    assert sentinel_overflow("float16", -1e9) == []  # bfloat16 holds -1e9; float16 is the tensor's own dtype
    [found] = sentinel_overflow("bfloat16", torch.finfo(torch.float32).min)  # only float16 is asked
    assert found.message.startswith("the fill value -3.40282e+38 does not fit float16 (lowest -65504): ")
    assert sentinel_overflow("float32", None) == []


def test_an_int_mask_whose_ones_mask_is_said_and_one_whose_ones_attend_is_not():
    assert [f.code for f in ones_masked(Convention("int", "structure", "", ones_mean="masked"))] == ["ones-masked"]
    assert ones_masked(Convention("int", "structure", "")) == [] and ones_masked(Convention("keep", "values", "")) == []


def test_what_a_trace_recorded_of_a_calls_scores():
    assert [f.code for f in fills({"fill_value": -1e4, "additive": True})] == ["finite-fill", "additive"]
    assert "-10000" in fills({"fill_value": -1e4})[0].message and fills({}) == []
    assert [f.code for f in bias({"bias": True})] == ["bias"] and bias({}) == []
    assert bias({"bias": True, "zero_one": True}) == []  # (a 0/1 float mask: ones-added says what it adds, no ALiBi)
    assert score_mod({"score_mod_read": "read: its -inf cells"}) == [] and score_mod({}) == []
    [mod] = score_mod({"score_mod_read": "not called: it raised", "score_mod_name": "alibi"})
    assert mod.code == "score-mod" and "the score_mod alibi was not called: it raised" in mod.message


def test_a_tensor_a_user_gave_has_its_fill_and_its_ones_read_through_the_registry():
    # inspect's Analysis (analyse runs the registry's "tensor" rules): a float16 tensor filled with -1e9 (which float16
    # holds as -inf, as torch casts it)
    import numpy as np

    from maskcli.inspect.analysis import analyse

    filled = Convention("additive", "values", "", sentinel=-1e9)
    assert torch.tensor(-1e9, dtype=torch.float16).item() == float("-inf")
    codes = lambda tensor, convention: [f.code for f in analyse(tensor, convention=convention).findings]
    assert codes(np.zeros((4, 4), dtype=np.float16), filled) == [f.code for f in sentinel_overflow("float16", -1e9)] == []
    # the tensor's own dtype is not asked: float16's and bfloat16's are
    assert codes(np.zeros((4, 4), dtype=np.float32), filled) == ["sentinel-overflow"]
    assert codes(np.zeros((4, 4), dtype=np.int64), Convention("int", "structure", "", ones_mean="masked")) == ["ones-masked"]