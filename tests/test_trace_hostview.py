"""trace/hostview.py: numpy views of the program's tensors that leave their storage resizable, as python leaves it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import maskcli
from maskcli.trace.hostview import host


def test_a_view_of_a_slice_reads_its_cells_and_leaves_the_storage_resizable():
    """Against `.clone().numpy()` of the same slice; `Tensor.numpy()` on it would mark the storage not resizable."""
    cache = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8)
    part = cache[:, 1:, :5].transpose(1, 2)
    assert np.array_equal(host(part), part.clone().numpy())
    assert cache.untyped_storage().resizable()
    cache.resize_(2, 3, 16)  # (raises where the storage was marked)
    grad = torch.ones(3, requires_grad=True)
    assert host(grad).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(TypeError):
        host(torch.zeros(2, dtype=torch.bfloat16))


def test_a_kv_cache_grown_by_resize_after_traced_calls_still_grows():
    """nanochat's KVCache.insert_kv before b062b42 (written blind, blind-wk): SDPA over views of one cache buffer,
    then `resize_` to grow it. Under trace the K/V readers took `.numpy()` of those views, so the resize raised
    "Trying to resize storage that is not resizable" where python ran on; it grows now, as under python."""
    cache = torch.zeros(1, 2, 8, 4)
    q = torch.randn(1, 2, 1, 4)
    with maskcli.trace() as traced:
        for step in range(3):
            cache[:, :, step] = torch.randn(1, 2, 4)
            keys = cache[:, :, :step + 1]
            F.scaled_dot_product_attention(q, keys, keys)
        cache.resize_(1, 2, 16, 4)
    assert cache.shape == (1, 2, 16, 4) and len(traced.calls) == 3
