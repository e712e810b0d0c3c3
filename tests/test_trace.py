"""maskcli.trace: each API's captured mask against an independent reference (SDPA's own output, nn.MultiheadAttention's
weights, FlexAttention's create_mask, a double loop), and the program's results untouched."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import maskcli
from maskcli.checks.registry import severity

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def window_keep(q_len: int, k_len: int, width: int) -> np.ndarray:
    """Queries at the end of the keys, each sees itself and the width-1 keys before it: a double loop."""
    out = np.zeros((q_len, k_len), dtype=bool)
    for i in range(q_len):
        q = k_len - q_len + i
        for k in range(k_len):
            out[i, k] = q - width < k <= q
    return out


def qkv(b, h, lq, lk, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g), torch.randn(b, h, lk, d, generator=g), torch.randn(b, h, lk, d, generator=g))


def test_sdpa_bool_float_and_is_causal_with_fewer_queries_than_keys():
    q, k, v = qkv(2, 3, 3, 7)
    wanted = window_keep(3, 7, 4)
    additive = torch.zeros(3, 7).masked_fill(~torch.from_numpy(wanted), float("-inf"))
    with maskcli.trace() as t:
        out_bool = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(wanted))
        out_float = F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
        out_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert [c.api for c in t.calls] == ["sdpa"] * 3 and all(c.shape == (2, 3, 3, 7) for c in t.calls)
    assert np.array_equal(t.calls[0].keep()[1, 2], wanted) and np.array_equal(t.calls[1].keep()[0, 0], wanted)
    assert t.calls[0].mask == t.calls[1].mask and len(t.masks) == 2  # one mask, given as bool and as float: stored once
    # is_causal is SDPA's top-left mask: the captured mask handed back to SDPA gives the same output
    replay = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(np.ascontiguousarray(t.calls[2].keep())))
    assert torch.allclose(replay, out_causal, atol=1e-6) and t.calls[2].details["is_causal"] is True
    assert np.array_equal(t.calls[2].keep()[0, 0], np.tril(np.ones((3, 7), dtype=bool)))
    untraced = (F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(wanted)), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(out_bool, untraced[0]) and torch.equal(out_causal, untraced[1]) and torch.equal(out_float, out_bool)


def test_a_key_padding_mask_broadcast_over_queries_is_captured_at_the_kernels_shape():
    q, k, v = qkv(2, 2, 4, 4)
    padding = torch.tensor([[True, True, True, False], [True, True, False, False]])[:, None, None, :]
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, attn_mask=padding)
    keep = t.calls[0].keep()
    assert keep.shape == (2, 2, 4, 4)
    for b, h, i, j in np.ndindex(keep.shape):
        assert keep[b, h, i, j] == bool(padding[b, 0, 0, j])


def test_mha_merges_attn_mask_and_key_padding_mask_as_multihead_attention_does():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    block = torch.ones(5, 5, dtype=torch.bool).triu(1)  # MHA's polarity: True = masked
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with maskcli.trace() as t:
        _, weights = mha(x, x, x, attn_mask=block, key_padding_mask=padding, average_attn_weights=False)
    (call,) = t.calls
    assert call.api == "mha" and call.where == "MultiheadAttention" and call.shape == (2, 2, 5, 5)
    keep = call.keep()
    for b, h, i, j in np.ndindex(keep.shape):
        assert keep[b, h, i, j] == (not block[i, j] and not padding[b, j])
        assert keep[b, h, i, j] == bool(weights[b, h, i, j] > 0)  # what MHA really weighted


def test_mha_with_bias_k_and_a_3d_per_head_mask():
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(4, 2, add_bias_kv=True).eval()
    x = torch.randn(3, 2, 4)  # (L, N, E)
    per_head = torch.rand(2 * 2, 3, 3) > 0.5
    per_head[:, :, 0] = False  # every query sees key 0
    with maskcli.trace() as t:
        _, weights = mha(x, x, x, attn_mask=per_head, average_attn_weights=False)
    keep = t.calls[0].keep()
    assert keep.shape == (2, 2, 3, 4)  # bias_k adds a key every query sees
    assert np.array_equal(keep, (weights > 0).numpy())
    assert np.array_equal(keep[..., :3], ~per_head.reshape(2, 2, 3, 3).numpy()) and keep[..., 3].all()


def test_flex_attention_mask_is_its_mask_mod_over_the_block_mask_without_l_by_l_cells():
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    docs = torch.tensor([0] * 70 + [1] * 60 + [2] * 70)

    def doc_window(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < 50 + 20 * h)

    q, k, v = qkv(1, 2, 200, 200)
    block_mask = create_block_mask(doc_window, 1, 2, 200, 200, device="cpu", BLOCK_SIZE=64)
    with maskcli.trace() as t:
        out = flex_attention(q, k, v, block_mask=block_mask)
        flex_attention(q, k, v)  # no block mask: nothing masked
    first, second = t.calls
    assert first.api == "flex" and first.stored["form"] == "intervals" and first.stored["planes"] == [1, 2]
    assert np.array_equal(first.keep(), create_mask(doc_window, 1, 2, 200, 200, device="cpu").numpy())
    assert second.keep().all()
    assert torch.equal(out, flex_attention(q, k, v, block_mask=block_mask))


def test_a_long_flex_mask_is_read_block_by_block_as_intervals():
    """32,768 tokens of window(1000): a BlockMask made from its blocks (no L x L tensor anywhere), read as one
    interval per row, equal to the window's double-loop definition row by row."""
    from torch.nn.attention.flex_attention import BlockMask

    from maskcli.trace.flex import block_intervals

    length, size, width = 32768, 128, 1000
    n = length // size

    def window(b, h, q, kv):
        return (q >= kv) & (q - kv < width)

    partial = np.full((1, 1, n, n), 0, dtype=np.int32)
    full = np.full((1, 1, n, n), 0, dtype=np.int32)
    partial_n = np.zeros((1, 1, n), dtype=np.int32)
    full_n = np.zeros((1, 1, n), dtype=np.int32)
    for i in range(n):  # the diagonal block and the window's far edge are partial, the blocks between are full
        p = [j for j in (i - 8, i - 7, i) if j >= 0]
        f = [j for j in range(i - 6, i) if j >= 0]
        partial[0, 0, i, : len(p)], partial_n[0, 0, i] = p, len(p)
        full[0, 0, i, : len(f)], full_n[0, 0, i] = f, len(f)
    block_mask = BlockMask.from_kv_blocks(torch.from_numpy(partial_n), torch.from_numpy(partial), torch.from_numpy(full_n),
                                          torch.from_numpy(full), BLOCK_SIZE=size, mask_mod=window)
    found, planes = block_intervals(block_mask, length, length)
    assert planes == (1, 1) and found.per_row == 1
    rows = np.arange(length)
    assert np.array_equal(found.starts[0, :, 0], np.maximum(0, rows - width + 1)) and np.array_equal(found.ends[0, :, 0], rows + 1)
    for q in (0, 5, 999, 1000, 20001, length - 1):  # a double loop on a few rows
        keys = [k for k in range(length) if q - width < k <= q]
        assert found.row(0, q) == [(keys[0], keys[-1] + 1)] and found.counts()[0, q] == len(keys)


def test_a_masked_fill_softmax_reads_the_mask_off_the_scores():
    scores = torch.randn(2, 4, 4)
    block = torch.ones(4, 4, dtype=torch.bool).triu(1)
    hf = torch.randn(1, 2, 3, 3) + torch.zeros(3, 3).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    with maskcli.trace() as t:
        weights = scores.masked_fill(block, float("-inf")).softmax(dim=-1)
        F.softmax(hf, dim=-1)
        torch.softmax(torch.randn(5, 3), dim=-1)  # 2-D: not attention
    assert [c.api for c in t.calls] == ["softmax", "softmax"]
    assert np.array_equal(t.calls[0].keep()[:, 0], np.broadcast_to(~block.numpy(), (2, 4, 4)))
    assert np.array_equal(t.calls[0].keep()[:, 0], (weights > 0).numpy())
    assert t.calls[0].details["fill"] == "-inf" and t.calls[1].details["fill"] == "min"
    assert np.array_equal(t.calls[1].keep()[0, 1], np.tril(np.ones((3, 3), dtype=bool)))


@pytest.mark.parametrize("dtype, fill", [(torch.float32, -1e9), (torch.float16, -1e4), (torch.bfloat16, -1e9)])
def test_a_finite_fill_is_read_as_masked_and_a_row_filled_everywhere_gets_uniform_weights(dtype, fill):
    """The Annotated Transformer's scores.masked_fill(mask == 0, -1e9): the cells at the fill are masked (their weight
    exactly 0 in every dtype), and a row filled everywhere gets uniform weights, which the finding says."""
    g = torch.Generator().manual_seed(1)
    scores = (torch.randn(2, 2, 4, 4, generator=g) * 4).to(dtype)
    lengths = [4, 0]  # batch row 1: every key padding
    mask = torch.tensor([[int(k < n) for k in range(4)] for n in lengths])[:, None, None, :] * torch.tril(torch.ones(4, 4))
    with maskcli.trace() as t:
        weights = scores.masked_fill(mask == 0, fill).softmax(dim=-1)
    (call,) = t.calls
    keep = np.broadcast_to(call.keep(), call.shape)
    for b in range(2):
        for q in range(4):
            for k in range(4):
                assert keep[b, 1, q, k] == (k <= q and k < lengths[b])
    assert np.array_equal(keep[0], (weights[0] > 0).numpy())  # where it is a mask, exactly what softmax did
    assert torch.equal(weights[1].float(), torch.full((2, 4, 4), 0.25))  # filled everywhere: uniform, not NaN
    assert call.details["fill"] == "finite" and call.details["fill_value"] == float(torch.tensor(fill, dtype=dtype))
    (group,) = t.groups()
    codes = {f.code: f.message for f in group.findings}
    assert codes["fully-masked"].startswith("query rows 0-3 of batch row 1 see no key at all: uniform weights")
    assert "a row filled everywhere gets uniform weights over every key" in codes["finite-fill"]


def test_an_additive_mask_in_the_scores_is_a_bias_read_where_its_weight_is_exactly_0():
    """BERT's (1 - mask) * -10000 added to the scores: no one constant, so no fill; read where softmax gives weight
    exactly 0, and a batch row whose every key it lowers attends to all of them (softmax is shift-invariant)."""
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 2, 4, 4, generator=g)
    lengths = [4, 2, 0]
    valid = torch.tensor([[float(k < n) for k in range(4)] for n in lengths])
    with maskcli.trace() as t:
        weights = (scores + (1.0 - valid[:, None, None, :]) * -10000.0).softmax(-1)
    (call,) = t.calls
    keep = np.broadcast_to(call.keep(), call.shape)
    for b in range(3):
        for k in range(4):
            assert keep[b, :, :, k].all() == (k < lengths[b] or lengths[b] == 0)
            assert not keep[b, :, :, k].any() == (k >= lengths[b] > 0)
    assert np.array_equal(keep, (weights > 0).numpy())
    assert call.details["additive"] is True and "fill_value" not in call.details
    (group,) = t.groups()
    assert [f.code for f in group.findings] == ["additive"]


def test_an_additive_mask_whose_cells_straddle_minus_1e4_is_no_fill():
    """DeepSpeed's BLOOM softmax adds input_mask * -10000 to the scores: a decode row's masked cells land on both sides
    of -1e4 (-9999.7 beside -10000.2). One cell at or below -1e4 is no constant fill: every masked cell is read where
    softmax gives it weight exactly 0, as the program computes."""
    scores = torch.tensor([0.3, 0.1, -0.2, 0.5, -0.4, 0.2])[None, None, None, :].repeat(2, 1, 1, 1)
    _padding_read_by_its_weights(scores)


def test_an_additive_mask_whose_cells_all_sit_just_above_minus_1e4_is_read_by_its_weights():
    """The same BLOOM softmax at a later layer: -10000 plus a positive score puts every padded key of the decode row
    just above -1e4 (-9999.7), none at or below it. Softmax still gives them weight exactly 0: read so, not as keys
    kept (which called the fix's padding seen)."""
    scores = torch.tensor([0.3, 0.1, 0.2, 0.5, -0.4, 0.2])[None, None, None, :].repeat(2, 1, 1, 1)
    assert float((scores + PAD[:, None, None, :] * -10000.0).min()) > -1e4
    _padding_read_by_its_weights(scores)


class Layer(nn.Module):
    def forward(self, x, cache):
        cache.append(x)
        keys = torch.cat(cache, dim=2)
        return F.scaled_dot_product_attention(x, keys, keys, is_causal=x.shape[2] > 1)


class Decoder(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, x, caches):
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache)
        return x


def test_a_decoding_loop_with_a_kv_cache_gives_steps_per_module():
    model = Decoder()
    caches = [[] for _ in model.layers]
    with maskcli.trace() as t:
        x = model(torch.randn(1, 2, 4, 8), caches)
        for _ in range(2):
            x = model(x[:, :, -1:], caches)
    assert [(c.where, c.step, c.shape[2:]) for c in t.calls[:3]] == [(f"layers.{i}", 0, (4, 4)) for i in range(3)]
    assert [(c.where, c.step, c.shape[2:]) for c in t.calls[-3:]] == [(f"layers.{i}", 2, (1, 6)) for i in range(3)]
    assert np.array_equal(t.calls[0].keep()[0, 0], np.tril(np.ones((4, 4), dtype=bool)))
    assert t.calls[-1].keep().all()  # a decode step's one query sees every cached key
    assert len(t.masks) == 3  # prefill, decode 1, decode 2: each stored once for three layers


class _OwnCallBlock(nn.Module):
    """A block written as MLX and Flax NNX ports write it: `__call__`, not `forward` (no _call_impl frame runs)."""

    def __call__(self, x, mask=None):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


class _OwnCallModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_OwnCallBlock(), _OwnCallBlock()])

    def __call__(self, x, mask=None):
        for layer in self.layers:
            x = layer(x, mask)
        return x


def test_modules_that_define_their_own_call_are_read_as_module_calls():
    model = _OwnCallModel()
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    with maskcli.trace() as t:
        model(torch.randn(1, 1, 3, 4), mask=mask)
        model(torch.randn(1, 1, 3, 4))
    assert [(c.where, c.step) for c in t.calls] == [("layers.0", 0), ("layers.1", 0), ("layers.0", 1), ("layers.1", 1)]
    assert [(top.where, top.first, top.end) for top in t.tops] == [("_OwnCallModel", 0, 2), ("_OwnCallModel", 2, 4)]
    assert np.array_equal(t.calls[0].keep()[0, 0], np.tril(np.ones((3, 3), dtype=bool)))


class _SuperCallBlock(nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    def __call__(self, x):  # (its own __call__ hands on to nn.Module's: one module call, read once)
        return super().__call__(x)


def test_a_call_that_hands_on_to_modules_own_is_one_module_call():
    model = nn.Sequential(_SuperCallBlock(), _SuperCallBlock())
    with maskcli.trace() as t:
        model(torch.randn(1, 1, 3, 4))
    assert [c.where for c in t.calls] == ["0", "1"] and [(top.first, top.end) for top in t.tops] == [(0, 2)]

def _decode_function(self, x, position_ids):
    """Attention in a plain function handed the layer as `self` (unsloth's fast decode forwards): no module call runs."""
    scores = x @ x.transpose(-1, -2)
    return torch.softmax(scores.masked_fill(~torch.ones(x.shape[-2], x.shape[-2]).tril().bool(), float("-inf")), dim=-1)


class _MethodModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def step(self, x, position_ids):  # (a model's method called as one, not through forward)
        return [_decode_function(layer, x, position_ids) for layer in self.layers]


def test_attention_in_functions_handed_a_module_is_read_as_that_modules_call():
    """No module call runs: the frames whose first argument is a module stand for them, innermost first: the layer's
    path for each call, and one model call (a Top, with its position_ids) per call of the model's method."""
    model = _MethodModel()
    with maskcli.trace() as t:
        for step in range(2):
            model.step(torch.randn(1, 1, 3, 4), torch.arange(3)[None] + step)
    assert [(c.where, c.step) for c in t.calls] == [("layers.0", 0), ("layers.1", 0), ("layers.0", 1), ("layers.1", 1)]
    assert [(top.where, top.first, top.end) for top in t.tops] == [("_MethodModel", 0, 2), ("_MethodModel", 2, 4)]
    assert np.array_equal(t.tops[1].arguments["position_ids"], np.arange(1, 4)[None])
    assert np.array_equal(t.calls[0].keep()[0, 0], np.tril(np.ones((3, 3), dtype=bool)))


def test_past_max_bytes_a_call_keeps_its_shape_and_counts_only():
    keep = torch.from_numpy(window_keep(64, 64, 5))
    q, k, v = qkv(1, 1, 64, 64)
    with maskcli.trace(max_bytes=100) as t:
        F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    stored = t.calls[0].stored
    assert stored["form"] == "stats" and stored["kept"] == int(keep.sum()) and stored["shape"] == [1, 1, 64, 64]
    with pytest.raises(maskcli.MaskError, match="max-bytes"):
        t.calls[0].keep()


def test_a_call_maskcli_cannot_read_is_noted_and_the_program_goes_on():
    q, k, v = qkv(1, 1, 2, 2)
    with maskcli.trace() as t:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(2, 2, dtype=torch.bool), is_causal=False)
        with pytest.raises(RuntimeError):  # SDPA itself refuses a mask with is_causal; the error is the program's own
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool))
    assert out.shape == (1, 1, 2, 8) and len(t.calls) == 2


def test_calls_under_inference_mode_are_read_with_a_mask_held_and_handed_in_every_layer():
    """Tensors made under torch.inference_mode have no version counter: each layer's call is read, not noted unread."""

    class Layer(nn.Module):
        def forward(self, x, mask):
            return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])

        def forward(self, x, attention_mask):
            mask = torch.ones(4, 4, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
            for layer in self.layers:
                x = layer(x, mask)
            return x

    lengths = [4, 3]
    wanted = np.zeros((2, 4, 4), dtype=bool)  # right-padded causal rows by a double loop
    for b in range(2):
        for i in range(4):
            for j in range(4):
                wanted[b, i, j] = j <= i and j < lengths[b]
    with maskcli.trace() as t, torch.inference_mode():
        Model()(torch.randn(2, 1, 4, 8), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))
    assert len(t.calls) == 2 and all("error" not in call.details for call in t.calls)
    for call in t.calls:
        assert np.array_equal(call.keep()[:, 0], wanted)


def test_report_groups_the_calls_and_names_each_mask():
    model = Decoder(layers=4)
    caches = [[] for _ in model.layers]
    with maskcli.trace() as t:
        x = model(torch.randn(1, 2, 4, 8), caches)
        model(x[:, :, -1:], caches)
    assert t.report().splitlines() == [
        "8 attention calls in 2 groups",
        "0. layers.{0-3} · sdpa · prefill · (1, 2, 4, 4) · causal",
        "1. layers.{0-3} · sdpa · decode 1 · (1, 2, 1, 5) · causal",
    ]


def test_assert_mask_passes_on_the_same_mask_and_names_the_first_differing_cells_otherwise():
    from maskcli.testing import assert_mask

    q, k, v = qkv(2, 1, 3, 6)
    padding = torch.tensor([[True] * 6, [False, False, True, True, True, True]])  # batch row 1: two pad keys on the left
    keep = torch.from_numpy(window_keep(3, 6, 3))[None, None] & padding[:, None, None, :]
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert_mask(t.calls[0], "window(3)", ids="1,1,1,1,1,1;0,0,1,1,1,1")
    # no ids given: the padding is read off the mask, by --expect's rule (maskcli.keypadding): batch row 1's key 1,
    # which batch row 0 sees (key 0 no row sees, so nothing says it is padding)
    assert_mask(t.calls[0], "window(3)")
    with pytest.raises(AssertionError, match=r"the mask is not window\(3\): 0 cells only the mask allows, 1 only window\(3\) allows; batch 1 row 3: "
                                             r"the mask sees 2-3, window\(3\) sees 1-3: the mask hides key 1$"):
        assert_mask(t.calls[0], "window(3)", lengths="6,6")  # full lengths: no padding at all
    assert_mask(keep[0, 0], "window(3)")  # a bool tensor, its queries placed at the end of its keys
    with pytest.raises(AssertionError, match=r"row 3: the mask sees 1-3, window\(4\) sees 0-3: the mask hides key 0"):
        assert_mask(keep[0, 0], "window(4)")
    with pytest.raises(AssertionError, match=r"the mask is not causal with the padding found \(ids='1,1,1,1,1,1;1,0,1,1,1,1', pad_id=0\).*"
                                             r"batch 1 row 3: the mask sees 2-3, causal sees 0, 2-3"):
        assert_mask(t.calls[0], "causal")


def test_import_maskcli_and_its_trace_package_load_no_torch():
    import subprocess
    import sys

    code = "import sys, maskcli; maskcli.trace; maskcli.testing; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_multihead_attention_and_transformer_encoder_keep_their_fast_paths_and_results():
    """An active mode would send them down their slow paths (other rounding, no nested tensors): traced, each
    computes exactly what it computes untraced, and its mask is still captured."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        untraced = (mha(x, x, x, need_weights=False, key_padding_mask=padding)[0], encoder(x, src_key_padding_mask=padding))
        with maskcli.trace() as t:
            traced = (mha(x, x, x, need_weights=False, key_padding_mask=padding)[0], encoder(x, src_key_padding_mask=padding))
    assert torch.equal(untraced[0], traced[0]) and torch.equal(untraced[1], traced[1])
    assert [(c.api, c.where) for c in t.calls] == [("mha", "MultiheadAttention"), ("mha", "layers.0.self_attn"), ("mha", "layers.1.self_attn")]
    for call in t.calls:
        keep = call.keep()
        for b, h, i, j in np.ndindex(keep.shape):
            assert keep[b, h, i, j] == (not padding[b, j])


def test_a_keep_mask_handed_to_multihead_attention_is_said_to_look_flipped():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 1).eval()
    x = torch.randn(4, 1, 4)
    keep = torch.ones(4, 4, dtype=torch.bool).tril()  # SDPA's polarity; MHA reads True as masked
    with maskcli.trace() as t:
        mha(x, x, x, attn_mask=keep)
    assert np.array_equal(t.calls[0].keep()[0, 0], np.triu(np.ones((4, 4), dtype=bool), 1))  # what MHA applied
    (group,) = t.groups()
    codes = {finding.code: finding.message for finding in group.findings}
    assert codes["polarity"].startswith("read the other way round it is causal") and "MHA reads a bool mask as True = masked" in codes["polarity"]

    # query 3 hides keys 0-3 (its row of tril is all True), yet key 3 is seen by query 0 (which hides key 0 only):
    # a real token with no key to read, so the softmax MHA runs gives NaN there (checks/rows.py, 580e420)
    assert codes["fully-masked"].startswith("query 3 of batch row 0 sees no key at all, not even its own, though its "
                                            "token is a real key that query 0 sees") and "NaN there" in codes["fully-masked"]
    assert {f.code: f.severity for f in group.findings}["fully-masked"] == "wrong"
    assert codes["sees-later"].startswith("query rows 0-2 see later keys")


def test_a_mask_hiding_each_querys_own_key_is_not_said_to_look_flipped():
    """SAITS' diagonally-masked attention (masked_fill(eye == 1, -1e9)): read the other way round it is window(1), each
    query seeing its own key alone, attention nobody means; the mask as given is read as meant. An eye handed to MHA
    (True = masked) is the same cells; a causal mask flipped is still said to look flipped (above)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
    eye = torch.eye(5)[None, None]
    with maskcli.trace() as t:
        scores = (q @ k.transpose(-2, -1)).masked_fill(eye == 1, -1e9)
        torch.softmax(scores, dim=-1) @ v
        nn.MultiheadAttention(4, 1).eval()(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), attn_mask=eye[0, 0].bool())
    assert [call.keep()[0, 0].tolist() for call in t.calls] == [(~np.eye(5, dtype=bool)).tolist()] * 2
    assert all(finding.code != "polarity" for group in t.groups() for finding in group.findings)


def test_where_and_step_words():
    from maskcli.text import step_text
    from maskcli.trace.report import where_text

    paths = [f"model.layers.{i}.self_attn" for i in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)] + ["model.vision.attn", "model.layers.5.self_attn"]
    assert where_text(paths) == "model.layers.{0-10}.self_attn, model.vision.attn"
    assert where_text(paths[:10]) == "model.layers.{0-4,6-10}.self_attn"
    assert where_text(["demo.py:12"]) == "demo.py:12" and where_text(["0", "1", "2", "3.attn"]) == "{0-2}, 3.attn"
    cases = {((0,), 7): "prefill", ((0,), 1): "step 0", ((1, 2, 3), 1): "decode 1-3", ((1,), 1): "decode 1",
             ((0, 1), 7): "prefill, step 1", ((1,), 7): "step 1", ((1, 2, 4), 7): "steps 1-2, 4",
             ((0, 1, 2), 1): "step 0, decode 1-2", ((0, 2, 3), 7): "prefill, steps 2-3"}
    assert {case: step_text(list(case[0]), case[1]) for case in cases} == cases


def test_calls_without_values_inside_vmap_or_on_meta_are_left_alone():
    with maskcli.trace() as t:
        batched = torch.vmap(lambda x: x.softmax(-1))(torch.zeros(3, 2, 4, 4))
        q = torch.randn(1, 1, 4, 8, device="meta")
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert t.calls == [] and torch.equal(batched, torch.full((3, 2, 4, 4), 0.25))


def test_a_large_bool_mask_is_read_band_by_band_into_intervals_and_many_runs_into_bits(monkeypatch):
    import maskcli.trace.store as store

    monkeypatch.setattr(store, "BAND", 64)  # bands of a few rows: the band edges are crossed many times
    length = 40
    q = torch.randn(1, 1, length, 4)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    stripes = torch.zeros(2, 1, length, 4 * 70, dtype=torch.bool)
    stripes[..., ::2] = True  # 140 runs a row: more than a few
    stripes[1, 0, 5, :] = False
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, q, q, attn_mask=causal)
        F.scaled_dot_product_attention(q.expand(2, 1, -1, -1), torch.randn(2, 1, 280, 4), torch.randn(2, 1, 280, 4), attn_mask=stripes)
    first, second = t.calls
    assert first.stored["form"] == "intervals" and first.stored["starts"].shape == (1, length, 1)
    assert np.array_equal(first.keep()[0, 0], np.tril(np.ones((length, length), dtype=bool)))
    assert second.stored["form"] == "bits" and np.array_equal(second.keep(), stripes.numpy())


def test_sdpa_with_grouped_query_attention_records_the_query_heads():
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, 3, 8)
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.5)
    (call,) = t.calls
    assert call.shape == (1, 4, 3, 3) and call.k == (1, 2, 3, 8)
    assert call.details["enable_gqa"] is True and call.details["scale"] == 0.5
    assert np.array_equal(call.keep()[0, 3], np.tril(np.ones((3, 3), dtype=bool)))


def test_one_mask_row_broadcast_over_query_rows_claims_no_query_sees_a_later_key():
    """HF's pack_gqa seen without the hf interface: 4 heads of one query as 4 query rows of one key/value head, the
    mask (B, 1, 1, Lk) broadcast over them. No row order there, so no sees-later finding; SDPA's output is the same."""
    q, k, v = qkv(2, 1, 4, 3)
    valid = torch.tensor([[False, True, True], [True, True, True]])
    mask = valid[:, None, None, :]
    with maskcli.trace(apis=("sdpa",)) as t:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    (call,) = t.calls
    keep = np.broadcast_to(call.keep(), call.shape)
    for b in range(2):
        for row in range(4):
            assert [bool(x) for x in keep[b, 0, row]] == [bool(valid[b, key]) for key in range(3)]
    (group,) = t.groups()
    assert [f.code for f in group.findings] == [] and call.details["mask_rows"] == 1


def test_pytorchs_own_transformer_every_attention_with_its_mask():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, batch_first=True).eval()
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    run = functools.partial(model, src, tgt, tgt_mask=causal, src_key_padding_mask=padding, memory_key_padding_mask=padding, tgt_is_causal=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        untraced = run()
        with maskcli.trace() as t:
            traced = run()
    assert torch.equal(untraced, traced)
    wheres = [c.where for c in t.calls]
    assert wheres == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn", "decoder.layers.0.self_attn",
                      "decoder.layers.0.multihead_attn", "decoder.layers.1.self_attn", "decoder.layers.1.multihead_attn"]
    for call in t.calls:
        keep = call.keep()
        for b, h, i, j in np.ndindex(keep.shape):
            wanted = j <= i if call.where.endswith("decoder.layers.0.self_attn") or call.where.endswith("decoder.layers.1.self_attn") else not padding[b, j]
            assert keep[b, h, i, j] == wanted, (call.where, b, h, i, j)


def test_a_float_mask_that_adds_a_bias_is_read_where_it_masks_and_said_to_be_a_bias():
    q, k, v = qkv(1, 2, 4, 4)
    positions = torch.arange(4)
    alibi = -(positions[:, None] - positions[None, :]).abs().float() * 0.5  # ALiBi-style slopes, no masked cell ...
    alibi = alibi.masked_fill(positions[None, :] > positions[:, None], float("-inf"))  # ... but causal
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, attn_mask=alibi)
    assert np.array_equal(t.calls[0].keep()[0, 0], np.tril(np.ones((4, 4), dtype=bool))) and t.calls[0].details["bias"]
    (group,) = t.groups()
    assert group.expression == "causal" and [f.code for f in group.findings] == ["bias"]


def test_a_float_mask_that_shifts_each_row_by_one_value_is_no_bias():
    """mlx-vlm#440's processor mask, a (1, L) row of ones cast to float and added: each query row's scores move by one
    value, which softmax does not see (the outputs equal an unmasked call's), so nothing says it adds a bias; a causal
    -inf beside a per-row constant neither. A row whose kept values differ is a bias."""
    q, k, v = qkv(1, 2, 5, 5)
    ones, shifted = torch.ones(1, 5), torch.arange(5.0)[:, None].expand(5, 5).clone()
    shifted = shifted.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=ones), F.scaled_dot_product_attention(q, k, v))
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=shifted),
                          F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    varied = torch.arange(5.0)[None, :].expand(5, 5).clone()
    with maskcli.trace() as t:
        for mask in (ones, shifted, varied):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert [bool(c.details.get("bias")) for c in t.calls] == [False, False, True]
    assert np.array_equal(t.calls[1].keep()[0, 0], np.tril(np.ones((5, 5), dtype=bool)))


def test_long_masks_are_named_on_their_intervals(monkeypatch):
    import maskcli.trace.report as report

    monkeypatch.setattr(report, "NAME_CELLS", 16)  # every mask here counts as too long to rebuild cell by cell
    q, k, v = qkv(1, 1, 6, 9)
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)  # top-left
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(window_keep(6, 9, 4)))
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(window_keep(6, 9, 9)))
        F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(window_keep(6, 9, 4) & (np.arange(9) != 7)))
    names = [group.name for group in t.groups()]
    assert names[:4] == ["causal (--kv-len 9)", "window(4)", "causal", "full"]  # (--kv-len alone: queries top-left)
    assert names[4].startswith("not named")


def test_with_mha_left_out_multihead_attention_still_keeps_its_fast_path():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        untraced = mha(x, x, x, need_weights=False)[0]
        with maskcli.trace(apis=("sdpa",)) as t:
            traced = mha(x, x, x, need_weights=False)[0]
    assert torch.equal(untraced, traced) and t.calls == []


def test_a_compiled_model_runs_traced_and_computes_the_same():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(x)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    torch.manual_seed(0)
    compiled = torch.compile(Attention(), backend="eager")
    x = torch.randn(1, 2, 4, 8)
    untraced = compiled(x)
    with maskcli.trace():  # the module hooks run inside dynamo's trace of forward: they must not break it
        traced = compiled(x)
    assert torch.equal(untraced, traced)


def test_a_trace_inside_a_trace_records_flex_calls_until_it_ends_and_then_the_outer_one_does():
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = qkv(1, 1, 4, 4)
    before = flex_attention(q, k, v)
    with maskcli.trace() as outer:
        with maskcli.trace() as inner:
            flex_attention(q, k, v)
        flex_attention(q, k, v)
    after = flex_attention(q, k, v)
    assert [c.api for c in inner.calls] == ["flex"] and [c.api for c in outer.calls] == ["flex"]
    assert flex_attention.__code__.co_name == "flex_attention" and "_maskcli" not in " ".join(flex_attention.__code__.co_names)
    assert torch.equal(after, before)


def _mha_with(mha: nn.MultiheadAttention, x: torch.Tensor, keep: np.ndarray) -> torch.Tensor:
    """nn.MultiheadAttention's output for batch-first self-attention recomputed with the mask `keep` through SDPA."""
    batch, length, embed = x.shape
    heads = mha.num_heads
    q, k, v = (t.view(batch, length, heads, embed // heads).transpose(1, 2)
               for t in F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(np.ascontiguousarray(keep)))
    return mha.out_proj(out.transpose(1, 2).reshape(batch, length, embed))


def test_multihead_attentions_fast_path_applies_attn_mask_and_ignores_is_causal_its_slow_path_the_reverse():
    """torch/nn/modules/activation.py (torch 2.13): the fast path (eval, no grad, batch_first, self-attention; lines
    1326-1447) merges attn_mask and key_padding_mask (merge_masks, 1524) and never reads is_causal; the slow path hands
    is_causal to F.multi_head_attention_forward, which drops attn_mask for SDPA's is_causal where there is no key
    padding and no weights (torch/nn/functional.py, 6817-6820). Each path's recorded mask recomputes its output."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    band = ~torch.from_numpy(window_keep(5, 5, 2))  # MHA's polarity: True = masked; a window, not causal
    causal = np.tril(np.ones((5, 5), dtype=bool))
    for grad, wanted in ((False, window_keep(5, 5, 2)), (True, causal)):
        with torch.set_grad_enabled(grad), maskcli.trace() as t:
            out = mha(x, x, x, attn_mask=band, is_causal=True, need_weights=False)[0]
        (call,) = t.calls
        assert np.array_equal(call.keep()[0, 0], wanted) and call.details.get("path") == (None if grad else "fast")
        with torch.no_grad():
            assert torch.allclose(out, _mha_with(mha, x, call.keep()), atol=1e-5)
    with torch.no_grad(), maskcli.trace() as t:  # is_causal with no mask: the slow path refuses it, the fast path
        out = mha(x, x, x, is_causal=True, need_weights=False)[0]  # applies no mask at all
    with torch.no_grad():
        assert torch.allclose(out, _mha_with(mha, x, np.ones((2, 2, 5, 5), dtype=bool)), atol=1e-5)
    assert t.calls[0].keep().all() and "no mask was applied" in t.calls[0].details["ignored_is_causal"]
    (group,) = t.groups()
    assert [f.code for f in group.findings] == ["ignored-is-causal"]  # one finding: hint-ignored does not repeat it
    assert severity(group.findings[0]) == "wrong"  # the program said is_causal; every key was seen
    finding = group.findings[0]
    assert (finding.expected, finding.source, finding.cell) == ("causal", "is_causal=True", (0, 0, 1))


def test_is_causal_beside_a_causal_mask_with_padding_on_the_fast_path_is_not_called_ignored():
    """A mask that is causal with padding rows (the fix of pytorch#99282, tests/data/bugs/mha_is_causal_need_weights.py)
    is what is_causal hints: the fast path applying it ignores nothing (torch/nn/modules/activation.py, torch 2.13,
    lines 1326-1447: the fast path never reads is_causal, and applies attn_mask merged by merge_masks)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    padding = torch.arange(5)[None, :] >= torch.tensor([5, 3])[:, None]  # True = a padding key
    mask = padding[:, None, :].expand(2, 5, 5).repeat_interleave(2, dim=0)
    mask = mask | nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.bool)  # True = masked
    with torch.no_grad(), maskcli.trace() as t:
        mha(x, x, x, attn_mask=mask, is_causal=True)
    assert t.calls[0].details.get("path") == "fast" and "ignored_is_causal" not in t.calls[0].details
    assert [f.code for f in t.groups()[0].findings] == []  # nor does hint-ignored find a query seeing a later key
    assert np.array_equal(t.calls[0].keep()[1, 0], np.tril(np.ones((5, 5), dtype=bool)) & (np.arange(5) < 3))


def test_an_encoder_layers_fast_path_ignores_is_causal_with_no_mask_and_its_slow_path_reads_it():
    """torch/nn/modules/transformer.py (torch 2.13), TransformerEncoderLayer.forward: the fast path (836-938) hands
    src_mask merged with the key padding to torch._transformer_encoder_layer_fwd, is_causal unread; the slow path's
    self_attn gets is_causal (_sa_block, 955-963), and MHA's slow path then applies causal in place of src_mask."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    band = ~torch.from_numpy(window_keep(5, 5, 2))
    for grad, mask, wanted, where in ((False, None, np.ones((5, 5), dtype=bool), "self_attn"),
                                      (False, band, window_keep(5, 5, 2), "self_attn"),
                                      (True, band, np.tril(np.ones((5, 5), dtype=bool)), "self_attn")):
        with torch.set_grad_enabled(grad), maskcli.trace() as t:
            out = layer(x, src_mask=mask, is_causal=True)
        (call,) = t.calls
        assert call.where == where and np.array_equal(call.keep()[0, 0], wanted), (grad, mask is None)
        with torch.set_grad_enabled(grad):  # the layer given the recorded mask (block polarity), no hint: same output
            again = layer(x, src_mask=torch.from_numpy(~np.ascontiguousarray(call.keep()[0, 0])))
        assert torch.allclose(out, again, atol=1e-5), (grad, mask is None)


def test_a_softmax_is_attention_when_its_input_came_from_q_at_k_transposed_or_its_shape_says_so():
    """maskcli.trace.scores: logits from a projection (a 2-D weight) are no scores, whatever their shape; a 3-D
    cross-attention score of 2 queries and 5 keys made by bmm or einsum is, through scaling and masked_fill."""
    torch.manual_seed(0)
    head = nn.Linear(8, 11)
    x, q, k = torch.randn(2, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 5, 8)
    block = torch.tensor([False, False, False, True, True])
    with maskcli.trace() as t:
        torch.softmax(head(x), dim=-1)  # (B, T, vocab)
        torch.softmax(x @ head.weight.T, dim=-1)  # tied weights written with @: one operand is 2-D
        (torch.bmm(q, k.transpose(1, 2)) / 8 ** 0.5).masked_fill(block, float("-inf")).softmax(-1)
        torch.einsum("bqd,bkd->bqk", q, k).softmax(-1)
        torch.softmax(torch.randn(2, 4, 4), dim=-1)  # made by hand, square: its shape says so
    assert [c.shape for c in t.calls] == [(6, 1, 2, 5), (6, 1, 2, 5), (2, 1, 4, 4)]
    assert np.array_equal(t.calls[0].keep()[0, 0], np.broadcast_to(~block.numpy(), (2, 5)))


def test_a_softmax_written_by_hand_with_exp_over_scores_is_one_call_and_other_exps_are_not():
    """maskcli.trace.masks.exp_softmax: exp(s - max(s)) / sum over q @ kᵀ scores (ONNX's reference Attention) and
    s.exp() / s.exp().sum() are each one call, masked where the scores are -inf (torch.tril's reference); exp of a
    positional table, or of scores maskcli saw no matmul make, is no call."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    causal = torch.ones(3, 5, dtype=torch.bool).tril(2)  # bottom-right: the 3 queries are the last of 5 keys
    with maskcli.trace() as t, torch.no_grad():
        torch.exp(torch.arange(0, 8, 2) * -0.5)  # a positional table's frequencies
        s = (q @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
        e = torch.exp(s - torch.amax(s, dim=-1, keepdim=True))
        weights = e / e.sum(-1, keepdim=True)
        b = torch.bmm(q[0], k[0].transpose(1, 2)) + torch.zeros(3, 5).masked_fill(~causal, float("-inf"))
        b.exp() / b.exp().sum(-1, keepdim=True)  # (the second exp of the same scores is a second call)
        torch.randn(1, 2, 3, 5).exp()  # no q @ kᵀ made it
    assert [c.shape for c in t.calls] == [(1, 2, 3, 5), (2, 1, 3, 5), (2, 1, 3, 5)]
    assert np.array_equal(t.calls[0].keep()[0, 1], causal.numpy())
    assert np.array_equal(t.calls[0].keep()[0, 0], (weights[0, 0] > 0).numpy())
    assert np.array_equal(t.calls[1].keep()[1, 0], causal.numpy())


def test_a_softmax_by_hand_over_einsum_scores_laid_query_first_is_read_over_their_keys():
    """exp over scores an einsum lays out (Lq, H, Lk) (sglang-jax's native backend, "qhd,khd->qhk", its rows shifted
    by their max and divided by their sum) is one call, read through the permuted view (H, Lq, Lk) as a softmax over
    them is (3-D: the heads on the batch axis): its keep is each query's keys by a double loop over the packed
    requests' lengths."""
    torch.manual_seed(0)
    lengths = [3, 2]  # two requests packed along one token axis, each causal over its own tokens
    total = sum(lengths)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        for i in range(n):
            for j in range(i + 1):
                allowed[start + i, start + j] = True
        start += n
    q, k = torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    with maskcli.trace() as t, torch.no_grad():
        logits = torch.einsum("qhd,khd->qhk", q, k) / 8 ** 0.5
        logits = torch.where(allowed[:, None, :], logits, torch.tensor(torch.finfo(logits.dtype).min))
        e = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
        e / e.sum(dim=-1, keepdim=True)
    assert [c.shape for c in t.calls] == [(2, 1, total, total)]
    for head in range(2):
        assert np.array_equal(t.calls[0].keep()[head, 0], allowed.numpy())


def test_one_querys_scores_squeezed_to_b_lk_are_attention_and_a_classifiers_are_not():
    """maskcli.trace.scores: bmm(memory, h[:, :, None]).squeeze(2) (Luong) is one query's (B, Lk) scores, read as a
    call (B, 1, 1, Lk) through its masked_fill; a (B, C) softmax over a classifier's logits is no call."""
    torch.manual_seed(0)
    memory, h, head = torch.randn(3, 6, 4), torch.randn(3, 4), nn.Linear(4, 5)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [True] + [False] * 5])
    with maskcli.trace() as t, torch.no_grad():
        torch.softmax(head(h), dim=-1)  # (B, classes)
        torch.bmm(memory, h[:, :, None]).squeeze(2).masked_fill(pad, float("-inf")).softmax(dim=1)
    assert [c.shape for c in t.calls] == [(3, 1, 1, 6)]
    assert np.array_equal(t.calls[0].keep()[:, 0, 0], ~pad.numpy())


def test_one_sequences_2d_scores_are_attention_and_a_projections_are_not():
    """maskcli.trace.scores: q.mm(k.T), torch.mm and @ of two 2-D tensors no parameter made (Graphormer's head over a
    graph batch's nodes) are one sequence's (Lq, Lk) scores: a softmax over them, through their scaling and masked_fill,
    is a call (1, 1, Lq, Lk) whose mask is the graphs' blocks by a double loop over `ptr`; a 2-D softmax over x @ W
    (a parameter, or its transpose) is no call."""
    torch.manual_seed(0)
    ptr, n = [0, 3, 7], 7
    same = torch.tensor([[any(ptr[g] <= i < ptr[g + 1] and ptr[g] <= j < ptr[g + 1] for g in range(len(ptr) - 1))
                          for j in range(n)] for i in range(n)])
    x, head, weight = torch.randn(n, 8), nn.Linear(8, 8), nn.Parameter(torch.randn(8, 5))
    with maskcli.trace() as t, torch.no_grad():
        q, k = head(x), head(x + 1)
        (x @ weight).softmax(-1)  # (a projection's logits)
        torch.softmax(x.mm(head.weight.t()), dim=-1)
        a = q.mm(k.transpose(0, 1)) / 8 ** 0.5
        torch.softmax(a.masked_fill(~same, float("-inf")), dim=-1)
        torch.softmax(torch.mm(q, k.t()).masked_fill(~same, float("-inf")), dim=1)
        F.softmax((q @ k.T).masked_fill(~same, float("-inf")), dim=-1)
    assert [c.shape for c in t.calls] == [(1, 1, n, n)] * 3
    for call in t.calls:
        assert np.array_equal(call.keep()[0, 0], same.numpy())


def test_flex_attention_masked_by_its_score_mod_is_recorded_as_the_kernel_masks():
    """A score_mod's -inf cells are masked as the BlockMask's are: read on the index grid in bands, checked against
    FlexAttention's own create_mask of the score_mod (torch/nn/attention/flex_attention.py 1735-1739: -inf cells
    are False) and against the kernel's output, recomputed with SDPA and the recorded mask."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    def per_head(score, b, h, q_idx, kv_idx):  # head 0 causal, head 1 a window of 2 keys
        return torch.where((q_idx >= kv_idx) & ((h == 0) | (q_idx - kv_idx < 2)), score, -float("inf"))

    def alibi(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score - (q_idx - kv_idx) * 0.5, -float("inf"))

    def clip(score, b, h, q_idx, kv_idx):  # masks by the score's value: no mask of positions
        return torch.where(score > 0.5, score, -float("inf"))

    q, k, v = qkv(2, 2, 6, 6)
    near = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 4, 1, 1, 6, 6, device="cpu", BLOCK_SIZE=2)
    with maskcli.trace() as t:
        outs = [flex_attention(q, k, v, score_mod=per_head), flex_attention(q, k, v, score_mod=per_head, block_mask=near),
                flex_attention(q, k, v, score_mod=alibi), flex_attention(q, k, v, score_mod=clip)]
    wanted = create_mask(per_head, 2, 2, 6, 6, device="cpu").numpy()
    near_cells = create_mask(near.mask_mod, 1, 1, 6, 6, device="cpu").numpy()
    assert np.array_equal(np.broadcast_to(t.calls[0].keep(), (2, 2, 6, 6)), wanted)
    assert np.array_equal(np.broadcast_to(t.calls[1].keep(), (2, 2, 6, 6)), wanted & near_cells)
    for call, out in zip(t.calls[:2], outs):
        replay = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(np.ascontiguousarray(np.broadcast_to(call.keep(), (2, 2, 6, 6)))))
        assert torch.allclose(out, replay, atol=1e-5)
    assert np.array_equal(t.calls[2].keep()[0, 0], np.tril(np.ones((6, 6), dtype=bool)))
    assert t.calls[3].details["score_mod_read"] == "not read: which cells it sets to -inf depends on the score's value"
    codes = [[(f.code, f.message) for f in g.findings] for g in t.groups()]
    assert codes[2] == [("score-mod", "the score_mod alibi also adds a bias where it does not mask: the mask shown is "
                                      "the cells it sets to -inf")]
    assert codes[3] == [("score-mod", "the score_mod clip was not read: which cells it sets to -inf depends on the "
                                      "score's value: the mask shown leaves out any cell it masks (sets to -inf)")]


def test_a_mask_given_again_is_read_once_with_what_reading_it_said_and_one_changed_in_place_is_read_again():
    q, k, v = qkv(1, 1, 4, 4)
    mask = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))  # causal, added
    mask[:, 0] += 0.5  # and a bias on key 0, which every query sees
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # the same tensor, unchanged: read once
        mask[3, 1] = float("-inf")  # changed in place between calls (its version counter moves)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    first, again, changed = t.calls
    expected = window_keep(4, 4, 4)  # causal: query i sees keys 0..i
    assert np.array_equal(first.keep()[0, 0], expected) and again.mask == first.mask
    assert first.details["bias"] and again.details["bias"]  # a call whose mask was read already says what the first said
    expected[3, 1] = False
    assert changed.mask != first.mask and np.array_equal(changed.keep()[0, 0], expected)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))  # the program's result untouched


def test_a_cpu_masks_runs_are_each_rows_maximal_runs_of_true_band_by_band(monkeypatch):
    import maskcli.trace.store as store

    monkeypatch.setattr(store, "BAND", 40)  # a few rows a band: band edges crossed
    rng = np.random.default_rng(0)
    cells = rng.random((3, 9, 13)) < 0.5
    cells[0] = True
    cells[1, 4] = False
    starts, ends = store._runs(torch.from_numpy(cells))
    for p in range(3):
        for r in range(9):
            runs, begin = [], None
            for key in range(14):  # a double loop over the cells, a False past the last key
                on = key < 13 and cells[p, r, key]
                if on and begin is None:
                    begin = key
                elif not on and begin is not None:
                    runs.append((begin, key))
                    begin = None
            got = [(int(s), int(e)) for s, e in zip(starts[p, r], ends[p, r]) if s < e]
            assert got == runs, (p, r)
            assert all(s == e == 13 for s, e in zip(starts[p, r, len(runs):], ends[p, r, len(runs):]))  # [Lk, Lk) pads


def test_the_config_a_program_states_in_its_frames_is_read_after_the_run_as_it_was_at_the_call():
    from maskcli.trace.stated import frames

    class RunConfig:
        def __init__(self):
            self.sliding_window = 3

    def program():
        run_config = RunConfig()  # noqa: F841 - read off this frame by the trace
        model = Decoder(layers=1)
        with maskcli.trace() as t:
            model(torch.randn(1, 2, 4, 8), [[]])
        return t

    t = program()
    assert t._pending  # not read while the program ran
    (top,) = t.tops  # read now, from the frames kept at the call: the function's variable, not the caller's
    assert [(s.source, s.fields["sliding_window"]) for s in top.stated] == [
        ("run_config (RunConfig) in program() of test_trace.py", 3)]
    assert not t._pending and frames(1)[0][0].startswith("in test_the_config_a_program_states")


def test_attention_over_no_token_is_recorded_and_named_empty_as_python_runs_it():
    """An empty prompt or batch: SDPA, a softmax and nn.MultiheadAttention run over 0 queries or 0 keys (python
    returns empty outputs, or 0 for queries with no key); each call is read, named empty, with no finding (the
    recogniser and the band reader met no row: 'zero-size array' and 'need at least one array')."""
    q, k, v = qkv(1, 2, 0, 0)
    few, none, _ = qkv(1, 2, 3, 0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    with maskcli.trace() as t:
        outs = [F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(0, 0, dtype=torch.bool)),
                F.scaled_dot_product_attention(few, none, none, attn_mask=torch.ones(3, 0, dtype=torch.bool)),
                torch.softmax(torch.randn(2, 1, 3, 0), -1),
                mha(torch.randn(1, 0, 8), torch.randn(1, 0, 8), torch.randn(1, 0, 8))[0]]
    reference = F.scaled_dot_product_attention(few, none, none)  # (its own run, untraced)
    assert [tuple(o.shape) for o in outs] == [(1, 2, 0, 8)] * 3 + [(1, 2, 3, 8), (2, 1, 3, 0), (1, 0, 8)]
    assert torch.equal(outs[3], reference)
    assert [c.shape for c in t.calls] == [(1, 2, 0, 0)] * 3 + [(1, 2, 3, 0), (2, 1, 3, 0), (1, 2, 0, 0)]
    assert all("error" not in c.details and c.keep().size == 0 for c in t.calls)
    assert [(g.name, len(g.calls), g.findings) for g in t.groups()] == [("empty: 0 queries, 0 keys", 3, [])] + \
        [("empty: 3 queries, 0 keys", 1, [])] * 2 + [("empty: 0 queries, 0 keys", 1, [])]


def test_hugging_faces_empty_cu_seq_lens_are_read_as_no_token():
    """An attention function of HF's AttentionInterface called with no packed sequence (cu_seq_lens_q/k empty, or [0])
    over 0 tokens: read from its arguments (it runs no kernel), named empty, as python runs it."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def nothing(module, query, key, value, attention_mask, **kwargs):
        return query.transpose(1, 2), None

    AttentionInterface.register("maskcli_test_nothing", nothing)
    module = nn.Module()
    module.is_causal = True
    x = torch.randn(1, 2, 0, 8)
    with maskcli.trace() as t:
        for cu in ([], [0], [0, 0]):
            cu = torch.tensor(cu, dtype=torch.int32)
            ALL_ATTENTION_FUNCTIONS["maskcli_test_nothing"](module, x, x, x, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                            max_length_q=0, max_length_k=0)
    assert [(c.api, c.shape, "error" in c.details) for c in t.calls] == [("hf", (1, 2, 0, 0), False)] * 3
    assert [(g.name, g.findings) for g in t.groups()] == [("empty: 0 queries, 0 keys", [])]


def test_a_config_whose_attribute_access_raises_is_not_read_and_the_program_runs_as_without_trace():
    """The config-like objects a model holds are read after its call (what the checks compare with): one whose
    __getattr__ raises a RuntimeError, or whose property raises a KeyError, ran under python and broke under trace."""

    class Refusing:
        def __getattr__(self, name):
            raise RuntimeError(f"no {name} here")

    class Raising:
        is_causal = True

        @property
        def sliding_window(self):
            raise KeyError("sliding_window")

    class Attention(nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    class Model(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config, self.attn = config, Attention()

        def forward(self, x, attention_mask=None):
            return self.attn(x)

    x = torch.randn(1, 1, 4, 8)
    models = [Model(Refusing()), Model(Raising())]
    plain = [model(x, attention_mask=torch.ones(1, 4)) for model in models]
    with maskcli.trace() as t:
        traced = [model(x, attention_mask=torch.ones(1, 4)) for model in models]
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    assert len(t.calls) == 2 and all(c.where.endswith("attn") and "error" not in c.details for c in t.calls)
    for call in t.calls:
        assert np.array_equal(call.keep()[0, 0], np.tril(np.ones((4, 4), dtype=bool)))


def test_an_attn_mask_that_mha_and_a_training_encoder_layer_drop_for_is_causal_is_said_to_be_dropped():
    """torch/nn/functional.py multi_head_attention_forward: "if is_causal and key_padding_mask is None and not
    need_weights: attn_mask = None" and SDPA runs is_causal: the window the program passed is never applied (its
    outputs are causal's, recomputed here). The finding names the mask passed and its first cell that differs from
    causal (a double loop); a causal mask passed with the hint, or one applied (need_weights), is no finding."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).train()
    x = torch.randn(2, 6, 8)
    window = window_keep(6, 6, 2)
    causal = np.tril(np.ones((6, 6), dtype=bool))
    first = next((q, k) for q in range(6) for k in range(6) if window[q, k] != causal[q, k])
    band = ~torch.from_numpy(window)  # MHA's polarity: True = masked
    with maskcli.trace() as t:
        out = mha(x, x, x, attn_mask=band, is_causal=True, need_weights=False)[0]
        layer(x, src_mask=band, is_causal=True)
        mha(x, x, x, attn_mask=~torch.from_numpy(causal), is_causal=True, need_weights=False)
        mha(x, x, x, attn_mask=band, is_causal=True, need_weights=True)
    with torch.no_grad():
        assert torch.allclose(out, _mha_with(mha, x, causal), atol=1e-5)
        assert not torch.allclose(out, _mha_with(mha, x, window), atol=1e-3)
    assert [c.where.rsplit(".", 1)[-1] for c in t.calls] == ["MultiheadAttention", "self_attn", "MultiheadAttention", "MultiheadAttention"]
    dropped = [c.details.get("dropped_attn_mask") for c in t.calls]
    assert dropped[2:] == [None, None]
    assert dropped[0] == dropped[1] == {"cell": [0, 0, *first], "keeps": False, "name": "window(2)"}
    groups = t.groups()  # the three causal calls form one group, the window applied (need_weights) another
    assert [[c.index for c in g.calls] for g in groups] == [[0, 1, 2], [3]]
    assert [[f.code for f in g.findings] for g in groups] == [["mask-dropped"], []]
    finding = groups[0].findings[0]
    assert severity(finding) == "wrong" and finding.cell == (0, *first)
    assert finding.message.startswith("the attn_mask passed (window(2)) was dropped: with is_causal=True")
    assert f"query {first[0]} sees key {first[1]}, which the mask passed masks" in finding.message


def test_torch_runs_untouched_but_for_attention_entry_points_and_as_it_was_once_the_trace_ends():
    """No mode is on while nothing is followed (trace/entry.py): q @ kᵀ turns it on, the next watched call once the
    scores are gone turns it off; every patched attribute and swapped code is put back at the end."""
    names = ("__add__", "__rsub__", "to", "softmax", "matmul")
    before = ([torch.Tensor.__dict__.get(n) for n in names], torch.softmax, torch.matmul,
              F.scaled_dot_product_attention, F.softmax.__code__, torch.einsum.__code__)
    q = torch.randn(1, 1, 4, 8)
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    modes = []

    def attend(q):  # (the scores, and the variables its frame holds, go when it returns)
        scores = q @ q.transpose(-1, -2)
        modes.append(torch._C._len_torch_function_stack())
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)

    with maskcli.trace() as t:
        q + 1
        modes.append(torch._C._len_torch_function_stack())
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        attend(q)
        q + 1
        modes.append(torch._C._len_torch_function_stack())
    after = ([torch.Tensor.__dict__.get(n) for n in names], torch.softmax, torch.matmul,
             F.scaled_dot_product_attention, F.softmax.__code__, torch.einsum.__code__)
    assert modes == [0, 1, 0] and torch._C._len_torch_function_stack() == 0
    assert after == before
    assert [c.api for c in t.calls] == ["sdpa", "softmax"]
    assert np.array_equal(t.calls[0].keep()[0, 0], torch.ones(4, 4, dtype=torch.bool).tril().numpy())
    assert np.array_equal(t.calls[1].keep()[0, 0], keep.numpy())


def test_mhas_functional_form_called_on_its_own_is_one_call_with_the_modules_mask():
    """F.multi_head_attention_forward called directly (no nn.MultiheadAttention around it) is recorded once, as the
    module computes it: its inner SDPA is its own, not a second call."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2).eval()
    x = torch.randn(5, 1, 8)
    window = torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.ones(5, 5, dtype=torch.bool).tril(-2)
    with maskcli.trace() as t:
        out, _ = F.multi_head_attention_forward(x, x, x, 8, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False,
                                                0.0, mha.out_proj.weight, mha.out_proj.bias, need_weights=False,
                                                attn_mask=~window)
    reference, _ = mha(x, x, x, attn_mask=~window, need_weights=False)
    assert torch.allclose(out, reference, atol=1e-6)
    assert [c.api for c in t.calls] == ["mha"]
    assert np.array_equal(t.calls[0].keep()[0, 0], window.numpy())


def test_a_mask_changed_in_place_after_its_call_is_read_as_it_was_then_and_equal_masks_are_stored_once():
    """A call's mask is copied at the call and read after the run (trace/store.py): a program that reuses one buffer
    gets each call's mask as it was at that call, and two tensors with the same cells are one stored mask."""
    q, k, v = qkv(1, 1, 4, 4)
    buffer = torch.ones(4, 4, dtype=torch.bool).tril()
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, attn_mask=buffer)
        buffer.fill_(True)  # the program's own tensor, changed after the call read it
        F.scaled_dot_product_attention(q, k, v, attn_mask=buffer)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4).tril().bool())  # the first's cells again
    first, full, again = t.calls
    assert np.array_equal(first.keep()[0, 0], np.tril(np.ones((4, 4), bool)))
    assert full.keep().all() and again.mask == first.mask != full.mask and len(t.masks) == 2


def test_past_the_copies_budget_masks_are_read_during_the_run_to_the_same_calls(monkeypatch):
    import maskcli.trace.store as store

    q, k, v = qkv(2, 1, 6, 6)
    masks = [torch.from_numpy(window_keep(6, 6, width)).expand(2, 1, 6, 6) for width in (1, 2, 3, 6)]
    found = []
    for budget in (store.UNREAD, 600):  # (one 36-cell copy and its tensor fit: the next one reads them)
        monkeypatch.setattr(store, "UNREAD", budget)
        with maskcli.trace() as t:
            for mask in masks:
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            waiting = len(t._unread)
        found.append(([call.mask for call in t.calls], waiting))
        for call, width in zip(t.calls, (1, 2, 3, 6)):
            assert np.array_equal(call.keep()[1, 0], window_keep(6, 6, width))
    assert found[0][0] == found[1][0] and found[0][1] == 4 and found[1][1] < 4


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_plus_inf_in_a_float_mask_is_said_to_make_those_rows_nan(value):
    """A NaN-filled attn_mask was named 'padding (--lengths 0)' with '0 output there', while SDPA gave NaN everywhere;
    one NaN cell in a row of zeros made that row NaN with no word."""
    q, k, v = qkv(1, 2, 4, 4)
    mask = torch.zeros(4, 4)
    mask[2, 1] = value
    with maskcli.trace() as t:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    nan_rows = out.isnan().any(dim=-1)[0, 0].tolist()  # torch's own output: which rows are NaN
    assert nan_rows == [False, False, True, False]
    (found,) = [f for f in t.groups()[0].findings if f.code == "mask-nan"]
    word = "NaN" if value != value else "+inf"
    assert found.message.startswith(f"the float attn_mask holds {word} (1 cell, in 1 of 4 query rows")
    assert severity(found) == "wrong"
    with maskcli.trace() as clean:
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(4, 4))
    assert not any(f.code == "mask-nan" for f in clean.groups()[0].findings)


def test_a_call_the_kernel_refused_is_said_to_have_run_no_attention():
    """SDPA refuses is_causal=2 and keys of another head size: each was reported as a 'causal' or 'full' call with no
    word that torch raised, as if attention had run with that mask."""
    q, k, v = qkv(1, 2, 4, 4)
    with maskcli.trace() as t:
        for bad in ({"is_causal": 2}, {"key": k[..., :3]}):
            given = {"query": q, "key": k, "value": v} | bad
            with pytest.raises((TypeError, RuntimeError)):
                F.scaled_dot_product_attention(**given)
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    refused = [c for c in t.calls if "raised" in c.details]
    assert [c.index for c in refused] == [0, 1] and refused[0].details["raised"].startswith("TypeError: ")
    said = [f.message for g in t.groups() for f in g.findings if f.code == "call-raised"]
    assert len(said) == 2 and all("did not complete, so no attention ran with this mask there" in m for m in said)


def test_a_routers_square_softmax_in_a_module_named_gate_is_no_attention_call():
    """Zaya's router: softmax over (batch, tokens, experts) logits from a Linear, square when the tokens are as many as
    the router's classes; inside `mlp.gate` it is no attention call. Scores a q @ kᵀ made stay attention there too."""
    torch.manual_seed(0)

    class Gate(nn.Module):
        def __init__(self, experts: int, scores: bool):
            super().__init__()
            self.proj, self.scores = nn.Linear(8, experts), scores

        def forward(self, x):
            logits = x @ x.transpose(1, 2) if self.scores else self.proj(x)
            return torch.softmax(logits, dim=-1)

    class Block(nn.Module):
        def __init__(self, scores: bool):
            super().__init__()
            self.mlp = nn.Module()
            self.mlp.gate = Gate(5, scores)

        def forward(self, x):
            return self.mlp.gate(x)

    x = torch.randn(2, 5, 8)
    for scores, calls in ((False, 0), (True, 1)):
        with maskcli.trace() as t:
            Block(scores)(x)
        assert len(t.calls) == calls, [c.where for c in t.calls]


@pytest.mark.parametrize("q_len, k_len", [(3, 7), (7, 7), (12, 8)])
def test_torchs_causal_bias_objects_run_as_under_python_and_are_read_as_their_cells(q_len, k_len):
    """torch.nn.attention.bias's CausalBias hands SDPA on to its own dispatch only when called as F's function (it
    compares identity with F's attribute): traced, the program gets the same output, and the mask read is the cells
    its dispatch materialises, each checked against a double loop (lower right: query i at key Lk - Lq + i)."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v = qkv(1, 2, q_len, k_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns of NaN rows where Lq > Lk, lower right)
        biases = (causal_lower_right(q_len, k_len), causal_upper_left(q_len, k_len))
        plain = [F.scaled_dot_product_attention(q, k, v, attn_mask=bias) for bias in biases]
        with maskcli.trace() as t:
            traced = [F.scaled_dot_product_attention(q, k, v, attn_mask=bias) for bias in biases]
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    assert len(t.calls) == 2  # (the dispatch's own SDPA inside is not a second call)
    for call, lower in zip(t.calls, (True, False), strict=True):
        wanted = np.array([[kk <= (k_len - q_len + i if lower else i) for kk in range(k_len)] for i in range(q_len)])
        assert np.array_equal(call.keep()[0, 0], wanted), lower


def test_sdpa_under_a_torch_function_mode_of_the_programs_is_handed_to_it_as_fs_function():
    """chengzeyi/ParaAttention#26's SparseKVAttnMode runs attention of its own where its __torch_function__ is handed
    F.scaled_dot_product_attention itself (it compares identity with F's attribute): traced, the mode gets F's
    attribute, the program's output is what python gives, and the calls recorded are those the mode ran (one per
    batch row, over the keys it kept), each row's keys checked against the mask it selected them by."""
    from torch.overrides import TorchFunctionMode

    class KeptKeys(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is not None:
                mask = kwargs.pop("attn_mask")
                q, k, v = args
                return torch.cat([F.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1, :, mask[i]], v[i:i + 1, :, mask[i]])
                                  for i in range(q.shape[0])])
            return func(*args, **kwargs)

    q, k, v = qkv(2, 2, 6, 6)
    keep = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    with KeptKeys():
        plain = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    with maskcli.trace() as t, KeptKeys():
        traced = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.equal(plain, traced)
    assert [c.shape for c in t.calls] == [(1, 2, 6, int(row.sum())) for row in keep]


def test_banded_scores_a_position_gathers_its_keys_into_are_no_query_by_key_call():
    """Longformer / LED's encoder (modeling_led.py, LEDEncoderSelfAttention) lays scores out (B, L, H, 2w + 1): each
    position's band of keys, not (B, H, Lq, Lk); read as such, positions were heads and heads queries, and LED's padded
    encoder batches were called fully-masked and padding-per-head. Written here another way (keys unfolded, einsum or a
    product summed): no call. A (B, H, Lq, Lk) softmax with as many queries as heads, made by q @ kᵀ, stays a call."""
    torch.manual_seed(0)

    class Band(nn.Module):
        def __init__(self, heads: int, w: int, einsum: bool):
            super().__init__()
            self.num_heads, self.w, self.einsum = heads, w, einsum

        def forward(self, q, k, lengths):
            w, length = self.w, q.shape[1]
            band = F.pad(k, (0, 0, 0, 0, w, w)).unfold(1, 2 * w + 1, 1)  # (B, L, H, D, 2w + 1)
            scores = torch.einsum("blhd,blhdj->blhj", q, band) if self.einsum else (q[..., None] * band).sum(-2)
            at = torch.arange(length)[:, None] + torch.arange(-w, w + 1)[None]  # the key position of each band cell
            outside = (at[None] < 0) | (at[None] >= lengths[:, None, None])
            probs = torch.softmax(scores.masked_fill(outside[:, :, None], float("-inf")), dim=-1)
            return probs.masked_fill((torch.arange(length)[None] >= lengths[:, None])[:, :, None, None], 0.0)

    q, k, lengths = torch.randn(2, 8, 2, 4), torch.randn(2, 8, 2, 4), torch.tensor([6, 5])
    for einsum in (True, False):
        with maskcli.trace() as t, torch.no_grad():
            Band(2, 2, einsum)(q, k, lengths)
        assert t.calls == [], [(c.where, c.shape) for c in t.calls]

    class Heads(nn.Module):  # (B, H, Lq, Lk) with 2 key heads and 4 queries in a module of 4 query heads
        num_heads = 4

        def forward(self, q, k):
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1)

    with maskcli.trace() as t, torch.no_grad():
        Heads()(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8))
    assert [c.shape for c in t.calls] == [(1, 2, 4, 6)]


def test_block_local_scores_joined_with_global_keys_are_no_query_by_key_scores():
    """Pegasus-X's global-local attention (transformers' PegasusXGlobalLocalAttention, written out): each block's
    queries score the global keys and their own block's keys, joined along the last axis of 5-D (B, H, blocks, X, G + Y)
    scores: keys that differ from block to block, no one row of key positions. The padded keys hidden there must not
    be read as a batch row's padding laid on another's heads (padding-per-head, a false alarm before)."""
    torch.manual_seed(0)
    batch, heads, blocks, size, globals_, dim = 2, 2, 3, 4, 2, 8
    local_q, local_k = torch.randn(2, batch, heads, blocks, size, dim).unbind(0)
    global_k = torch.randn(batch, heads, globals_, dim)
    padding = torch.zeros(batch, blocks * size)
    padding[1, -3:] = -1e9  # row 1's last three tokens are padding
    with maskcli.trace() as t:
        to_global = torch.einsum("BHNXF,BHGF->BHNXG", local_q, global_k)
        to_local = torch.einsum("BHNXF,BHNYF->BHNXY", local_q, local_k) + padding.view(batch, 1, blocks, 1, size)
        torch.softmax(torch.cat([to_global, to_local], dim=-1), dim=-1)
    assert all(finding.code != "padding-per-head" for group in t.groups() for finding in group.findings)


PAD = torch.tensor([[0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)  # batch row 1: 3 padding keys


def _padding_read_by_its_weights(scores):
    """BLOOM's softmax of scores + padding * -10000, traced: its one call keeps exactly the keys PAD says are real
    (a double loop), which are the keys softmax weighs above 0, read as an additive mask."""
    with maskcli.trace() as t:
        weights = (scores + PAD[:, None, None, :] * -10000.0).softmax(-1)
    (call,) = t.calls
    keep = np.broadcast_to(call.keep(), call.shape)
    for b in range(2):
        for k in range(6):
            assert keep[b, 0, 0, k] == (PAD[b, k] == 0)
    assert np.array_equal(keep, (weights > 0).numpy())
    assert call.details["additive"] is True and "fill_value" not in call.details
