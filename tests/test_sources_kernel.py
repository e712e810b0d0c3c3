"""sources/kernel.py: a kernel format's tensors (--from FORMAT) read back as the mask they describe, checked against a
double loop over absolute positions."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.errors import MaskError
from maskcli.mask import MaskOptions
from maskcli.sources import registry


def packed_causal(sizes: list[int]) -> np.ndarray:
    """Keep cells of packed causal documents, by a double loop over absolute positions."""
    total = sum(sizes)
    doc = np.repeat(np.arange(len(sizes)), sizes)
    return np.array([[doc[q] == doc[k] and k <= q for k in range(total)] for q in range(total)])


def test_the_registry_sends_from_format_to_the_kernel_source(tmp_path):
    path = str(tmp_path / "fa.npz")
    assert registry.for_file(path, MaskOptions(from_="flash-attn")).name == "kernel"
    assert registry.for_file(path, MaskOptions(from_="keep")).name == "tensor"


def test_flash_attn_cu_seqlens_read_back_as_packed_documents(tmp_path):
    path = tmp_path / "fa.npz"
    np.savez(path, cu_seqlens_q=np.array([0, 3, 8], dtype=np.int32), cu_seqlens_k=np.array([0, 3, 8], dtype=np.int32))
    mask = registry.load(None, MaskOptions(mask_file=str(path), from_="flash-attn", causal=True))
    assert np.array_equal(mask.dense()[0, 0], packed_causal([3, 5]))


def test_an_unknown_from_lists_the_readable_formats(tmp_path):
    np.savez(tmp_path / "x.npz", a=np.zeros(2))
    with pytest.raises(MaskError, match=r"unknown --from 'nope': choose keep or block .* a format: .*flash-attn"):
        registry.load(None, MaskOptions(mask_file=str(tmp_path / "x.npz"), from_="nope"))
