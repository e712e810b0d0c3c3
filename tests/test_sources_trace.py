"""sources/trace.py: a selector names one call of a saved trace, and TRACE.pt:CALL reads back as that call's mask,
cell for cell, placed as a tensor file's is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskcli import tracefile
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions
from maskcli.sources import registry, trace


def test_selectors_name_a_call_by_index_or_module_path_and_step():
    data = {"calls": [{"index": 0, "where": "layers.0.attn", "step": 0}, {"index": 1, "where": "layers.0.attn", "step": 1}]}
    assert trace.select(data, "1", "t.pt")["index"] == 1
    assert trace.select(data, "layers.0.attn@1", "t.pt")["index"] == 1
    for bad, message in (("2", "numbered 0 to 1"), ("layers.0.attn@5", "no call of 'layers.0.attn' at step 5"), ("attn", "MODULE_PATH@STEP")):
        with pytest.raises(MaskError, match=message):
            trace.select(data, bad, "t.pt")
    assert trace.split_spec("t.pt:layers.5.self_attn@2") == ("t.pt", "layers.5.self_attn@2")
    assert trace.split_spec("mask.npy:3") is None and trace.split_spec("t.pt") is None



@pytest.mark.parametrize("selector", ["9" * 5000, "rank" + "9" * 5000 + ":0", "layers.0.attn@" + "9" * 5000])
def test_an_index_rank_or_step_of_thousands_of_digits_is_one_short_line(selector):
    data = {"calls": [{"index": 0, "where": "layers.0.attn", "step": 0, "rank": 0}]}
    with pytest.raises(MaskError) as raised:  # was "unexpected ValueError: Exceeds the limit (4300 digits)"
        trace.select(data, selector, "t.pt")
    assert "5,000 digits name no call, rank or step of a trace" in str(raised.value) and len(str(raised.value)) < 300

def test_a_call_named_by_its_file_and_line_is_found():
    from maskcli.sources.trace import select, split_spec

    assert split_spec("t.pt:script.py:9") == ("t.pt", "script.py:9")
    assert split_spec("t.pt:script.py:9@1") == ("t.pt", "script.py:9@1")
    assert split_spec("runs/t.pt:7") == ("runs/t.pt", "7") and split_spec("t.npy") is None
    data = {"calls": [{"where": "script.py:9", "step": 0, "index": 0}, {"where": "m.attn", "step": 0, "index": 1},
                      {"where": "m.attn", "step": 1, "index": 2}]}
    assert select(data, "script.py:9", "t.pt")["index"] == 0
    assert select(data, "m.attn@1", "t.pt")["index"] == 2
    with pytest.raises(MaskError, match=r"m.attn made 2 calls \(steps 0, 1\): name one as t.pt:m.attn@STEP"):
        select(data, "m.attn", "t.pt")


def _saved(tmp_path, keeps: list[np.ndarray]) -> str:
    """A trace file of one call per keep array, as maskcli trace --save writes it."""
    masks, calls = {}, []
    for index, keep in enumerate(keeps):
        stored = tracefile.from_dense(keep, keep.shape)
        masks[tracefile.digest(stored)] = stored
        calls.append({"index": index, "where": f"layers.{index}.attn", "step": 0, "api": "sdpa", "shape": list(keep.shape),
                      "mask": tracefile.digest(stored)})
    path = tmp_path / "t.pt"
    tracefile.save(path, calls, masks)
    return str(path)


def test_the_registry_reads_a_traced_call_as_its_keep_cells(tmp_path):
    causal = torch.ones(6, 6, dtype=torch.bool).tril().numpy()[None, None]  # the reference: torch.tril
    band = np.zeros((1, 2, 3, 6), dtype=bool)
    band[0, 1, :, 2:5] = True  # head 1 sees keys 2..4, head 0 nothing
    path = _saved(tmp_path, [causal, band])
    assert registry.for_file(f"{path}:0", MaskOptions()).name == "trace"
    assert np.array_equal(registry.load(None, MaskOptions(mask_file=f"{path}:0")).dense(), causal)
    second = registry.load(None, MaskOptions(mask_file=f"{path}:layers.1.attn@0"))
    assert np.array_equal(second.dense(), band) and second.frame.q_start == 3  # queries last, as in a cache
    assert "layers.1.attn" in second.text


def test_a_traced_call_refuses_the_options_of_a_tensor_file(tmp_path):
    path = _saved(tmp_path, [np.ones((1, 1, 2, 2), dtype=bool)])
    with pytest.raises(MaskError, match=r"--key does not apply to .*t.pt:0.*drop --key"):
        registry.load(None, MaskOptions(mask_file=f"{path}:0", key="x"))
    assert not trace.claims(str(tmp_path / "missing.pt:0")) and not trace.claims(path)


def test_inspect_reads_a_traced_call_in_keep_form_with_its_key_padding(tmp_path):
    keep = torch.ones(3, 3, dtype=torch.bool).tril().numpy()[None, None]
    path = _saved(tmp_path, [keep])
    values, label, padding, keep_form = registry.values(f"{path}:0", None, None, (11, "to inspect"))
    assert keep_form and padding is None and np.array_equal(values, keep) and "layers.0.attn" in label
    with pytest.raises(MaskError, match="--key and --from do not apply to"):
        registry.values(f"{path}:0", None, "block", (11, "to inspect"))

