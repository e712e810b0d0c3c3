"""sources/tensor.py: a --mask FILE of one tensor reads back as its keep cells, whichever convention it is written in,
its queries at the end of its keys; a file it cannot read as one mask says which option reads it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskcli.errors import MaskError
from maskcli.mask import MaskOptions
from maskcli.sources import registry
from maskcli.sources.tensor import load_mask


def test_the_registry_sends_a_tensor_file_to_the_tensor_source(tmp_path):
    path = tmp_path / "m.npy"
    np.save(path, np.tril(np.ones((3, 3), dtype=bool)))
    assert registry.for_file(str(path), MaskOptions()).name == "tensor"
    assert registry.for_file(str(path), MaskOptions(from_="block")).name == "tensor"


@pytest.mark.parametrize("written", ["keep", "block", "additive"])
def test_a_tensor_reads_back_as_its_keep_cells_in_any_convention(tmp_path, written):
    keep = torch.ones(2, 5, 7, dtype=torch.bool).tril(diagonal=2)  # reference: torch.tril, bottom-right aligned
    value = {"keep": keep, "block": ~keep, "additive": torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))}[written]
    path = tmp_path / "m.pt"
    torch.save(value[:, None], path)
    mask = registry.load(None, MaskOptions(mask_file=str(path)))
    assert np.array_equal(mask.dense(), keep[:, None].numpy())
    assert mask.frame.q_start == 2 and mask.frame.k_start == 0  # 5 queries at the end of 7 keys


def test_from_names_the_convention_a_tensor_cannot_show(tmp_path):
    cells = np.zeros((4, 4), dtype=bool)  # every cell False: nothing or everything masked, the values cannot tell
    np.save(tmp_path / "d.npy", cells)
    with pytest.raises(MaskError, match=r"cannot tell whether .* say which with --from keep or --from block"):
        registry.load(None, MaskOptions(mask_file=str(tmp_path / "d.npy")))
    blocked = registry.load(None, MaskOptions(mask_file=str(tmp_path / "d.npy"), from_="block"))
    assert np.array_equal(blocked.dense()[0, 0], ~cells)


def test_load_mask_chooses_a_tensor_by_key_and_says_which_format_a_kernel_file_is(tmp_path):
    path = tmp_path / "two.npz"
    np.savez(path, a=np.ones((2, 2), dtype=bool), b=np.zeros((2, 3), dtype=np.int8))
    values, label = load_mask(str(path), "b")
    assert values.shape == (2, 3) and label.endswith("['b']")
    with pytest.raises(MaskError, match="holds several tensors \\('a', 'b'\\): choose one with --key"):
        load_mask(str(path))
    np.savez(tmp_path / "fa.npz", cu_seqlens_q=np.array([0, 3]), cu_seqlens_k=np.array([0, 3]))
    with pytest.raises(MaskError, match="read it with --from flash-attn"):
        load_mask(str(tmp_path / "fa.npz"))


def test_inspect_reads_a_tensor_file_as_its_values_in_their_own_convention(tmp_path):
    block = ~np.tril(np.ones((4, 4), dtype=bool))
    np.save(tmp_path / "b.npy", block)
    values, label, padding, keep_form = registry.values(str(tmp_path / "b.npy"), None, None, (11, "to inspect"))
    assert not keep_form and padding is None and np.array_equal(values, block) and "b.npy" in label

