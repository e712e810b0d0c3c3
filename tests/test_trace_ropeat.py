"""trace/ropeat.py: the largest position a rotary table encodes, against tables built here from their definition."""

from __future__ import annotations

import torch

from maskcli.trace.ropeat import _positions


def _table(positions, dim: int, base: float, interleaved: bool = False):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.tensor(positions, dtype=torch.float32)[..., None] * inv
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin(), (inv.double(), 1.0)


def test_positions_read_off_the_lowest_frequency():
    cos, sin, freqs = _table([1000.0, 3.0, 0.0], 64, 10000.0)
    assert _positions(cos, sin, freqs, 1) == [1000]
    cos, sin, freqs = _table([[100000.0]], 128, 500000.0)  # (a large base, far positions)
    assert _positions(cos, sin, freqs, 1) == [100000]


def test_one_position_per_batch_row():
    cos, sin, freqs = _table([[5.0, 6.0], [2.0, 3.0]], 16, 10000.0)
    assert _positions(cos, sin, freqs, 2) == [6, 3]


def test_other_layouts_and_scaled_tables_are_not_read():
    cos, sin, freqs = _table([1000.0], 64, 10000.0, interleaved=True)  # (GPT-J's pairs: another frequency per column)
    assert _positions(cos, sin, freqs, 1) is None
    cos, sin, freqs = _table([10.0], 64, 10000.0)
    assert _positions(cos * 1.2, sin * 1.2, freqs, 1) is None  # (YaRN's attention scaling: no unit circle)


def test_without_frequencies_only_position_zero_is_read():
    cos, sin, _ = _table([0.0], 32, 10000.0)
    assert _positions(cos, sin, None, 1) == [0]
    cos, sin, _ = _table([7.0], 32, 10000.0)
    assert _positions(cos, sin, None, 1) is None


def test_a_joined_table_is_split_by_its_name():
    """One tensor of sin and cos joined on the last axis: sin first (RoFormer's sinusoidal_pos, GPT-J's sincos), cos
    first where the name says so; a tensor of another name or an odd width is no table."""
    from maskcli.trace.ropeat import _table as held

    cos, sin, freqs = _table([[4.0, 9.0]], 16, 10000.0)
    half = cos.shape[-1] // 2
    for name, joined in (("sinusoidal_pos", torch.cat([sin[..., :half], cos[..., :half]], -1)),
                         ("sincos", torch.cat([sin[..., :half], cos[..., :half]], -1)),
                         ("cos_sin", torch.cat([cos[..., :half], sin[..., :half]], -1))):
        found = held({name: joined})
        assert found is not None and found[0] == name
        assert _positions(found[1], found[2], freqs, 1) == [9]
    assert held({"sinusoids": torch.cat([sin, cos], -1)}) is None
    assert held({"sincos": torch.zeros(2, 7)}) is None
