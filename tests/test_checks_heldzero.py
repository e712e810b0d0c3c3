"""trace/zerokeys.py and checks/heldzero.py: the keys a program zeroed in K alone, read as its statement of padding."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from maskcli.checks.heldzero import named_other_way, zeroed_as_real
from maskcli.trace.zerokeys import zero_keys


def test_zero_keys_against_a_loop_over_every_head_and_dimension():
    """Keys zero in every head and dimension of K, per batch row, by a plain loop; a key zero in one head only, or in
    the first dimension only, is not one."""
    k = torch.randn(3, 2, 6, 4)
    k[0, :, 4:] = 0  # (row 0: keys 4-5 zeroed, as masked_fill(~real, 0) does)
    k[1, :, :] = 0  # (row 1: every key)
    k[2, 0, 1] = 0  # (row 2: key 1 in head 0 only)
    k[2, :, 3, 0] = 0  # (row 2: key 3 in its first dimension only)
    v = torch.randn(3, 2, 6, 4)
    want = np.array([[all(float(k[b, h, j, d]) == 0 for h in range(2) for d in range(4)) for j in range(6)]
                     for b in range(3)])
    assert np.array_equal(zero_keys(k, v, tuple(k.shape))["zero_keys"], want)
    assert zero_keys(torch.randn(3, 2, 6, 4), v, (3, 2, 6, 4)) == {}  # (no key zero)
    v[0, :, 4:], v[1] = 0, 0  # (zero in V too: slots nobody wrote, zerokv.py's, not keys zeroed as padding)
    assert zero_keys(k, v, tuple(k.shape)) == {}


def test_the_keys_a_padding_name_calls_real_zeroed_say_it_is_a_keep_mask():
    """Dia's `padding_mask` (True = real under a padding's name): read as padding, its real keys are those the program
    zeroed in K, in each padded row; a zeroing elsewhere (or none) states nothing."""
    table = np.array([[False] * 4, [True, True, False, False]])  # (row 0: all padding; row 1: two real)
    real = ~table  # (the name's reading: True = padding)
    padded = ~real.all(axis=1)
    call = SimpleNamespace(details={"zero_keys": ~table})  # (K zeroed where the table is False)
    assert zeroed_as_real(call, real, padded, 0)
    assert not zeroed_as_real(SimpleNamespace(details={"zero_keys": table}), real, padded, 0)
    assert not zeroed_as_real(SimpleNamespace(details={}), real, padded, 0)


def _run(*helds_per_call):
    calls = [SimpleNamespace(details={"held_padding": list(helds)}) for helds in helds_per_call]
    return SimpleNamespace(calls=calls, cross=[])


def test_a_padding_name_the_program_hands_on_as_a_keep_mask_says_its_padding_names_are_keep_masks():
    """KerasHub's BART (quiet-r138a, a false alarm before): `padding_mask` and `encoder_padding_mask` are True = real
    there, and the decoder's `decoder_padding_mask` is held elsewhere as `mask` (a keep name) with the very same rows:
    the program's padding names follow the other convention, so none of them states padding the kernel contradicts.
    A table named as padding whose rows no keep name holds, in a program where no padding name is held so, still
    states padding; a keep-named table is not read through the padding names' convention."""
    source = np.array([[True] * 5 + [False] * 3, [True] * 2 + [False] * 6])
    target = np.array([[True, True, False], [True, True, True]])
    encoder = {"kind": "pad", "name": "padding_mask", "rows": source}
    decoder = {"kind": "pad", "name": "decoder_padding_mask", "rows": target}
    handed = {"kind": "keep", "name": "mask", "rows": target.copy()}
    assert named_other_way(_run([encoder, decoder], [handed]), encoder)
    assert named_other_way(_run([encoder, decoder], [handed]), decoder)
    assert not named_other_way(_run([encoder, decoder]), encoder)  # (no name of the other way holds any of them)
    other = {"kind": "pad", "name": "pad_mask", "rows": source}  # (not of the `padding_mask` family)
    assert not named_other_way(_run([other, decoder], [handed]), other)
    keep = {"kind": "keep", "name": "attention_mask", "rows": source}
    assert not named_other_way(_run([keep, decoder], [handed]), keep)
