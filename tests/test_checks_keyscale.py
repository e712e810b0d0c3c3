"""checks/keyscale.py: cached keys an earlier call read come back with every rotary pair's norm times one factor (a
move that was no rotation); against YaRN's attention factor and torch's own rotations."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from checkbugs import check_bug
from maskcli.trace import keyscale

KEYSCALE = Path(__file__).parent / "data" / "keyscale"
YARN_SQUARED = (0.1 * math.log(4.0) + 1.0) ** 2  # YaRN's attention factor for a scale of 4, applied twice


def _factor(message: str) -> float:
    return float(re.search(r"every pair's norm times ([0-9.]+)", message).group(1))


def test_kvpress_key_rerotation_press_yarn_positions_double_scaled(tmp_path):
    """NVIDIA/kvpress#85 (written blind, batch blind-ec): KeyRerotationPress un-rotates and re-rotates the kept keys
    with the layer's position_embeddings, whose cos/sin carry YaRN's attention_scaling, so the kept keys come back
    scaled by attention_scaling²; the fix rotates by the position delta from inv_freq alone. (The draft's question
    step, `is_causal` over a cache, aligned top-left, was a bug of its own: masked bottom-right since.)"""
    [hit, *_] = check_bug(tmp_path, "kvpress_key_rerotation_press_yarn_positions_double_scaled", "keys-rescaled")
    assert abs(_factor(hit["message"]) - YARN_SQUARED) < 1e-3


def test_sink_cache_shift_with_scaled_freqs_cis_written_another_way(tmp_path):
    """The same bug in a StreamingLLM-style sink cache: complex freqs_cis (interleaved pairs) carrying mscale, the
    kept keys shifted by `freqs_cis[new] * freqs_cis[old].conj()`, a batch of 2 decoded token by token."""
    [hit, *_] = check_bug(tmp_path, "sink_cache_shift_complex_rope_mscale", "keys-rescaled", KEYSCALE)
    assert abs(_factor(hit["message"]) - YARN_SQUARED) < 1e-3


def test_rotated_keys_are_quiet_and_scaled_ones_are_found():
    """Keys turned pair by pair (rotate_half's pairing) come back unscaled; the same turned and times 1.5 come back
    with that factor; a new trace finds none of the last one's keys; a step that appends its own keys is not read."""
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 6, 16)
    angle = torch.rand(8)
    cos, sin = torch.cat((angle, angle)).cos(), torch.cat((angle, angle)).sin()
    turned = keys * cos + torch.cat((-keys[..., 8:], keys[..., :8]), -1) * sin
    keyscale.forget()
    assert keyscale.keys_rescaled(keys, tuple(keys.shape)) == {}
    assert keyscale.keys_rescaled(turned, tuple(turned.shape)) == {}
    found = keyscale.keys_rescaled(turned * 1.5, tuple(turned.shape))["keys_rescaled"]
    assert found["factor"] == 1.5 and found["keys"] == 6 and found["of"] == 6  # (batch row 0, head 0)
    keyscale.forget()
    assert keyscale.keys_rescaled(turned * 2, tuple(turned.shape)) == {}
    grown = torch.cat((turned * 1.5, torch.randn(1, 2, 1, 16)), 2)  # (6 keys, then 7: a cache that grew)
    assert keyscale.keys_rescaled(grown, tuple(grown.shape)) == {}
    keyscale.forget()


def test_a_cache_of_unwritten_slots_is_read_without_a_warning_under_the_programs_line():
    """mistral-inference's BufferCache is allocated with torch.empty: a masked slot may hold anything, 1e30 say. The
    keys' reading squares them (keys_rescaled) under numpy's errstate, so no overflow warning is shown under the
    program's attention line, as python alone shows none; the program's own numpy warns as before."""
    import warnings

    import numpy as np
    import torch
    import torch.nn.functional as F

    import maskcli

    torch.manual_seed(0)
    q = torch.randn(1, 2, 2, 8)
    cache = torch.randn(1, 2, 6, 8)
    cache[:, :, 4:] = 1e30  # (unwritten slots: masked below)
    keep = torch.tensor([[True] * 4 + [False] * 2] * 2)
    with warnings.catch_warnings(record=True) as caught, maskcli.trace():
        warnings.simplefilter("always")
        for _ in range(2):  # (a site's second call over the same shape is the one its last keys are read against)
            out = F.scaled_dot_product_attention(q, cache.clone(), cache.clone(), attn_mask=keep)
        np.square(np.float32(1e30))  # the program's own overflow
    assert torch.isfinite(out).all()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert said == ["overflow encountered in square"], said
