"""Kernel formats (maskcli/formats) against each library's documented masking rule.

SDPA, nn.MultiheadAttention and FlexAttention run here on the CPU. FlashAttention, FlashInfer,
FlashMask, MagiAttention and xformers are GPU-only: each test below writes its documented rule
as a reference (cited beside it) and compares it cell for cell with maskcli's own cells, for
random expressions each format can hold.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from maskcli.formats import flash_attn, flashinfer, flashmask, flex, hf, magi, mha, sdpa, xformers
from maskcli.formats.base import CannotHold, transpose
from maskcli.mask import build

rng = np.random.default_rng(23)


def random_sizes(n_docs: int, most: int = 7) -> list[int]:
    return [int(x) for x in rng.integers(1, most + 1, size=n_docs)]


def band_masks(count: int = 40):
    """Random masks of packed sequences with one band inside each: what the varlen kernels hold."""
    out = []
    for _ in range(count):
        sizes = random_sizes(int(rng.integers(1, 5)))
        w = int(rng.integers(1, 6))
        choice = int(rng.integers(0, 7))
        expr = [f"document(sizes={sizes})", f"document(sizes={sizes}) & window({w})", f"segment(sizes={sizes})", "causal",
                f"window({w})", f"segment(sizes={sizes}) & window({w})", f"segment(sizes={sizes}) & ~tril({-w})"][choice]
        flags = {}
        if expr in ("causal", f"window({w})"):
            n = int(rng.integers(2, 12))
            flags = {"length": n}
            if rng.random() < 0.5:
                flags["offset"] = int(rng.integers(1, 6))  # queries behind a cache: bottom-right
        out.append((expr, flags))
    out += [("causal", {"length": 7, "lengths": "7,4,1"}), ("window(3)", {"length": 6, "lengths": "6,2"}),
            ("local(3)", {"length": 9}), ("full", {"length": 5})]
    return out


def ragged_masks(count: int = 30):
    """Random masks with more than one run of keys per row, or non-monotone edges."""
    out = []
    for _ in range(count):
        n = int(rng.integers(3, 13))
        ids = [int(x) for x in rng.integers(-1, 2, size=n)]
        w = int(rng.integers(1, 5))
        choice = int(rng.integers(0, 5))
        expr = [f"causal | blocks({','.join(map(str, ids))})", f"causal & (window({w}) | sink(2))", "prefix(3)",
                f"document(sizes={random_sizes(3)}) | sink(1)", f"causal & ~window({w})"][choice]
        out.append((expr, {} if "sizes" in expr or "blocks" in expr else {"length": n}))
    return out


def keep_of(expr, flags) -> np.ndarray:
    return build(expr, **flags).dense()[:, 0]  # (B, Lq, Lk)


def packed(expr, flags) -> np.ndarray:
    """maskcli's cells as the varlen kernels see them: each batch row's real tokens, packed one after another."""
    m = build(expr, **flags)
    keep = m.dense()[:, 0]
    if not m.frame.padded:
        return keep[0]
    blocks = []
    for b in range(m.batch):
        real = np.flatnonzero(m.frame.key_valid[b])
        blocks.append(keep[b][np.ix_(real, real)])
    total = sum(len(x) for x in blocks)
    out = np.zeros((total, total), dtype=bool)
    at = 0
    for block in blocks:
        out[at:at + len(block), at:at + len(block)] = block
        at += len(block)
    return out


# --- FlashAttention varlen ---------------------------------------------------------------------


def flash_reference(cu_q, cu_k, causal, window) -> np.ndarray:
    """flash_attn_varlen_func's documented rule (flash_attn README, "window_size"): query i of a sequence
    sees keys j in [i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]],
    -1 = no limit; causal=True is window_size[1] = 0, aligned bottom-right."""
    left, right = window
    if causal:
        right = 0
    out = np.zeros((cu_q[-1], cu_k[-1]), dtype=bool)
    for n in range(len(cu_q) - 1):
        lq, lk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        for i in range(lq):
            for j in range(lk):
                diag = i + lk - lq
                if (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right):
                    out[cu_q[n] + i, cu_k[n] + j] = True
    return out


@pytest.mark.parametrize("expr, flags", band_masks())
def test_flash_attn_is_the_mask_by_the_documented_rule(expr, flags):
    result = flash_attn.to(build(expr, **flags))
    code = "\n".join(result.code)
    causal = "causal=True" in code
    window = tuple(int(x) for x in re.search(r"window_size=\((-?\d+), (-?\d+)\)", code).groups())
    got = flash_reference(result.tensors["cu_seqlens_q"].tolist(), result.tensors["cu_seqlens_k"].tolist(), causal, window)
    assert np.array_equal(got, packed(expr, flags)), (expr, flags, window)


def kvcache_reference(seqlens, leftpad, q_len, causal, window) -> np.ndarray:
    """flash_attn_with_kvcache's documented rule: row b's keys are cache slots [cache_leftpad[b], cache_seqlens[b]);
    causal and window_size are aligned bottom-right, so query i faces slot i + cache_seqlens[b] - q_len."""
    left, right = window
    right = 0 if causal else right
    out = np.zeros((len(seqlens), q_len, max(seqlens)), dtype=bool)
    for b, (n, pad) in enumerate(zip(seqlens, leftpad)):
        for i in range(q_len):
            diag = i + n - q_len
            for j in range(pad, n):
                out[b, i, j] = (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
    return out


@pytest.mark.parametrize("expr, ids", [("causal", "0,0,5,6,7,8;1,2,3,4,5,6"), ("window(2)", "0,3,4,5,6,7;0,0,0,1,2,3"),
                                       ("causal & ~window(2)", "0,1,2,3,4,5;0,0,2,3,4,5")])
def test_flash_attn_behind_a_left_padded_cache_is_the_kvcache_rule(expr, ids):
    m = build(expr, length=2, offset=4, ids=ids)
    try:
        result = flash_attn.to(m)
    except CannotHold:
        assert expr.startswith("causal & ~")  # keys before the window and none after: no band
        return
    t = result.tensors
    code = "\n".join(result.code)
    assert "flash_attn_with_kvcache" in code
    window = tuple(t["window_size"].tolist())
    got = kvcache_reference(t["cache_seqlens"].tolist(), t["cache_leftpad"].tolist(), int(t["seqlen_q"]), "causal=True" in code, window)
    assert np.array_equal(got, m.dense()[:, 0])


def test_an_hf_window_of_w_keys_is_window_size_w_minus_1():
    code = "\n".join(flash_attn.to(build("window(128)", length=300)).code)
    assert "causal=True, window_size=(127, 0)" in code


@pytest.mark.parametrize("expr, flags", ragged_masks(10))
def test_flash_attn_refuses_what_it_cannot_hold(expr, flags):
    keep = keep_of(expr, flags)[0]
    with pytest.raises(CannotHold, match="flash-attn varlen cannot express .*: use --for flex or magi"):
        result = flash_attn.to(build(expr, **flags))
        # a refusal is only right where no band holds it: if one was given, it must be exact
        code = "\n".join(result.code)
        window = tuple(int(x) for x in re.search(r"window_size=\((-?\d+), (-?\d+)\)", code).groups())
        assert np.array_equal(flash_reference(result.tensors["cu_seqlens_q"].tolist(), result.tensors["cu_seqlens_k"].tolist(), "causal=True" in code, window), keep)
        raise CannotHold("flash-attn varlen cannot express it, and held it exactly: use --for flex or magi")


# --- FlashInfer --------------------------------------------------------------------------------


def flashinfer_reference(result) -> np.ndarray:
    """BatchPrefillWithRaggedKVCacheWrapper.plan's documented rule: causal aligns bottom-right, window_left
    keeps j >= i + kv_len - qo_len - window_left (-1: none); a custom_mask is each request's (qo_len, kv_len)
    keep matrix flattened, packed by flashinfer.packbits(..., bitorder="little")."""
    t = result.tensors
    qo, kv = t["qo_indptr"].tolist(), t["kv_indptr"].tolist()
    out = np.zeros((qo[-1], kv[-1]), dtype=bool)
    code = "\n".join(result.code)
    if "packed_custom_mask" in t:
        packed_bits, indptr = t["packed_custom_mask"], t["packed_mask_indptr"]
        for n in range(len(qo) - 1):
            lq, lk = qo[n + 1] - qo[n], kv[n + 1] - kv[n]
            bits = np.unpackbits(packed_bits[indptr[n]:indptr[n + 1]], bitorder="little")[: lq * lk]
            out[qo[n]:qo[n + 1], kv[n]:kv[n + 1]] = bits.reshape(lq, lk).astype(bool)
            flat = t["custom_mask"][sum((qo[m + 1] - qo[m]) * (kv[m + 1] - kv[m]) for m in range(n)):][: lq * lk]
            assert np.array_equal(flat.reshape(lq, lk), out[qo[n]:qo[n + 1], kv[n]:kv[n + 1]])
        return out
    causal = "causal=True" in code
    left = int(re.search(r"window_left=(-?\d+)", code).group(1))
    for n in range(len(qo) - 1):
        lq, lk = qo[n + 1] - qo[n], kv[n + 1] - kv[n]
        for i in range(lq):
            for j in range(lk):
                diag = i + lk - lq
                out[qo[n] + i, kv[n] + j] = (not causal or j <= diag) and (left < 0 or j >= diag - left)
    return out


@pytest.mark.parametrize("expr, flags", band_masks(15) + ragged_masks(10))
def test_flashinfer_is_the_mask_by_the_documented_rule(expr, flags):
    result = flashinfer.to(build(expr, **flags))
    expected = packed(expr, flags)
    if "packed_custom_mask" in result.tensors and build(expr, **flags).batch > 1:
        expected = np.zeros_like(flashinfer_reference(result))
        keep = keep_of(expr, flags)
        lq, lk = keep.shape[1:]
        for b in range(len(keep)):
            expected[b * lq:(b + 1) * lq, b * lk:(b + 1) * lk] = keep[b]
    assert np.array_equal(flashinfer_reference(result), expected), expr


# --- FlashMask ---------------------------------------------------------------------------------


def flashmask_reference(indices: np.ndarray, causal: bool) -> np.ndarray:
    """Keep cells (B, L, L) from startend_row_indices as PaddlePaddle's flashmask_to_densemask builds the
    dense mask in its flashmask tests: per key column j, rows [LTS, LTE) (or [LTS, L)) masked, and rows
    < j when causal, else [UTS, UTE) (or [0, UTE))."""
    batch, _, length, bounds = indices.shape
    masked = np.zeros((batch, length, length), dtype=bool)
    has_end = (causal and bounds == 2) or (not causal and bounds == 4)
    for b in range(batch):
        for j in range(length):
            down = indices[b, 0, j, 0]
            if has_end:
                masked[b, down:indices[b, 0, j, 1], j] = True
            else:
                masked[b, down:, j] = True
            if causal:
                masked[b, :j, j] = True
            elif has_end:
                masked[b, indices[b, 0, j, 2]:indices[b, 0, j, 3], j] = True
            else:
                masked[b, :indices[b, 0, j, 1], j] = True
    return ~masked


@pytest.mark.parametrize("expr, flags", [(e, f) for e, f in band_masks(20) + ragged_masks(20) if "offset" not in f])
def test_flashmask_is_the_mask_by_paddles_reference(expr, flags):
    m = build(expr, **flags)
    try:
        result = flashmask.to(m)
    except CannotHold as why:
        assert re.search(r"hides \d+ separate runs", str(why)), why
        keep = keep_of(expr, flags)
        # the refusal is right: some column hides two runs of rows on one side of the diagonal
        runs = [np.count_nonzero(np.diff(np.concatenate([[0], ~col, [0]]).astype(int)) == 1) for col in
                (keep[b][lo:hi, j] for b in range(len(keep)) for j in range(keep.shape[2]) for lo, hi in ((j, keep.shape[1]), (0, j)))]
        assert max(runs) > 1
        return
    indices = result.tensors["startend_row_indices"]
    assert indices.dtype == np.int32
    assert np.array_equal(flashmask_reference(indices, bool(result.tensors["causal"])), keep_of(expr, flags)), expr


def test_flashmask_causal_document_uses_one_bound_per_column():
    result = flashmask.to(build("document(sizes=[3,5])"))
    assert result.tensors["startend_row_indices"][0, 0, :, 0].tolist() == [3, 3, 3, 8, 8, 8, 8, 8]
    assert bool(result.tensors["causal"])


def test_the_column_view_of_a_million_token_window_is_o_of_l():
    m = build("document(sizes=[400000,600000]) & window(4096)", length=1_000_000)
    starts, ends = transpose(*(np.broadcast_to(a, (1, 1_000_000, 1))[0] for a in (m.intervals().starts, m.intervals().ends)), 0, 1_000_000)
    j = np.arange(1_000_000)
    doc_end = np.where(j < 400000, 400000, 1_000_000)
    assert np.array_equal(starts[:, 0], j) and np.array_equal(ends[:, 0], np.minimum(j + 4096, doc_end))


# --- MagiAttention -----------------------------------------------------------------------------


def magi_reference(q_ranges, k_ranges, types, total_q, total_k) -> np.ndarray:
    """MagiAttention's AttnMaskType rule: per slice of lq queries x lk keys (local i, j), FULL keeps all,
    CAUSAL keeps j <= i + lk - lq (bottom-right), INVCAUSAL keeps j >= i (top-left), BICAUSAL both;
    the mask is the union of the slices."""
    out = np.zeros((total_q, total_k), dtype=bool)
    for (qs, qe), (ks, ke), t in zip(q_ranges.tolist(), k_ranges.tolist(), types.tolist()):
        lq, lk = qe - qs, ke - ks
        for i in range(lq):
            for j in range(lk):
                causal_ok = j <= i + lk - lq
                inv_ok = j >= i
                if t == 0 or (t == 1 and causal_ok) or (t == 2 and inv_ok) or (t == 3 and causal_ok and inv_ok):
                    out[qs + i, ks + j] = True
    return out


@pytest.mark.parametrize("expr, flags", band_masks(20) + ragged_masks(20))
def test_magi_ranges_are_the_mask_by_the_documented_rule(expr, flags):
    m = build(expr, **flags)
    t = magi.to(m).tensors
    keep = keep_of(expr, flags)
    batch, lq, lk = keep.shape
    expected = np.zeros((batch * lq, batch * lk), dtype=bool)
    for b in range(batch):
        expected[b * lq:(b + 1) * lq, b * lk:(b + 1) * lk] = keep[b]
    got = magi_reference(t["q_ranges"], t["k_ranges"], t["attn_type_map"], int(t["total_seqlen_q"]), int(t["total_seqlen_k"]))
    assert np.array_equal(got, expected), expr
    assert {int(x) for x in t["attn_type_map"]} <= {0, 1, 2, 3}


def test_a_causal_document_is_one_causal_slice_each():
    t = magi.to(build("document(sizes=[3,5])")).tensors
    assert t["q_ranges"].tolist() == [[0, 3], [3, 8]] and t["k_ranges"].tolist() == [[0, 3], [3, 8]]
    assert t["attn_type_map"].tolist() == [1, 1]


# --- xformers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("expr, flags", band_masks(30))
def test_xformers_bias_is_the_mask_by_its_documented_rule(expr, flags, monkeypatch):
    """The printed call run with a stand-in of xformers 0.0.35's attn_bias classes (their signatures and documented
    rule: tests/test_export_gpu_calls.py), its cells compared with maskcli's, packed as the kernel sees them."""
    from test_export_gpu_calls import run_xformers

    m = build(expr, **flags)
    try:
        result = xformers.to(m)
    except CannotHold as why:
        assert "window past the diagonal" in str(why)
        return
    expected = torch.from_numpy(packed(expr, flags))
    q = torch.randn(1, expected.shape[0], 1, 4)
    k = v = torch.randn(1, expected.shape[1], 1, 4)
    _, cells = run_xformers("\n".join(result.code), q, k, v, monkeypatch, real=False)
    assert torch.equal(cells, expected), expr


def test_xformers_window_counts_the_query_itself():
    code = "\n".join(xformers.to(build("document(sizes=[3,5]) & window(2)")).code)
    assert "BlockDiagonalCausalMask.from_seqlens([3, 5]).make_local_attention(2)" in code


# --- SDPA, MHA, Hugging Face and flex: run by torch ------------------------------------------------


def inputs(batch, heads, lq, lk, d=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, heads, lq, d, generator=g), torch.randn(batch, heads, lk, d, generator=g),
            torch.randn(batch, heads, lk, d, generator=g))


def reference_attention(q, k, v, keep):
    """softmax(q k^T / sqrt(d) masked by keep) v, 0 for rows that see no key: the documented meaning."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.as_tensor(keep), float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ v


def seen_rows(keep):
    return torch.as_tensor(keep).any(-1)


@pytest.mark.parametrize("expr, flags", band_masks(10) + ragged_masks(10) + [("causal", {"length": 4, "offset": 3})])
def test_sdpa_runs_the_mask(expr, flags):
    m = build(expr, **flags)
    result = sdpa.to(m)
    keep = m.dense()
    q, k, v = inputs(m.batch, 2, *keep.shape[2:])
    code = "\n".join(result.code)
    if "is_causal=True" in code:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif "causal_lower_right" in code:
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(*keep.shape[2:]))
    elif "attn_mask=None" in code:
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(result.tensors["attn_mask"]))
    seen = seen_rows(keep)[..., None] & torch.ones_like(out, dtype=torch.bool)
    assert torch.allclose(out[seen], reference_attention(q, k, v, keep)[seen], atol=1e-5), expr


@pytest.mark.parametrize("expr, flags", band_masks(8) + ragged_masks(8) + [
    ("causal", {"length": 5, "lengths": "5,3", "heads": 2}), ("document(0,0,1,1;0,1,1,1)", {"heads": 2}),  # rows differ: (B * heads, Lq, Lk)
])
def test_mha_runs_the_inverted_masks(expr, flags):
    m = build(expr, **flags)
    result = mha.to(m)
    keep = np.broadcast_to(m.dense(), m.shape)
    heads = m.heads
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(8 * heads, heads, batch_first=True).eval()
    x = torch.randn(m.batch, m.frame.q_len, 8 * heads)
    memory = torch.randn(m.batch, m.frame.k_len, 8 * heads)
    masks = {name: torch.from_numpy(value) for name, value in result.tensors.items()}
    with torch.no_grad():
        out, _ = layer(x, memory, memory, **masks)
        # the reference: MultiheadAttention with the whole (B * heads, Lq, Lk) block mask, True = masked
        want, _ = layer(x, memory, memory, attn_mask=torch.from_numpy(~keep.reshape(-1, *keep.shape[2:]).copy()))
    seen = torch.from_numpy(keep[:, 0].any(-1))
    assert torch.allclose(out[seen], want[seen], atol=1e-5), expr


@pytest.mark.parametrize("expr, flags", [("document(sizes=[3,5]) & window(2)", {}), ("causal", {"length": 6, "lengths": "6,3"}),
                                         ("segment(sizes=[2,2,3])", {})])
def test_hf_mask_added_to_the_scores_is_the_mask(expr, flags):
    m = build(expr, **flags)
    t = hf.to(m).tensors
    mask4d = torch.from_numpy(t["attention_mask"])
    assert mask4d.shape == (m.batch, 1, m.frame.q_len, m.frame.k_len)
    q, k, v = inputs(m.batch, 2, m.frame.q_len, m.frame.k_len)
    for dtype in (torch.float32, torch.bfloat16):  # eager attention: scores + mask in the model's dtype, softmax in float32
        cast = mask4d.clamp(min=torch.finfo(dtype).min).to(dtype)
        assert not torch.isinf(cast).any()
        scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / 8 ** 0.5 + cast
        out = torch.softmax(scores.float(), -1) @ v
        keep = m.dense()
        seen = seen_rows(keep)[..., None] & torch.ones_like(out, dtype=torch.bool)
        assert torch.allclose(out[seen], reference_attention(q, k, v, keep)[seen], atol=0.05 if dtype == torch.bfloat16 else 1e-5)


def test_hf_position_ids_restart_in_each_document():
    t = hf.to(build("document(sizes=[3,5]) & window(2)")).tensors
    labels = [0, 0, 0, 1, 1, 1, 1, 1]
    expected, at = [], 0
    for i, label in enumerate(labels):  # a loop over the labels: the position inside the document
        at = 0 if i == 0 or labels[i - 1] != label else at + 1
        expected.append(at)
    assert t["position_ids"].tolist() == [expected]
    assert "position_ids" not in hf.to(build("causal", length=4)).tensors


@pytest.mark.parametrize("expr, flags, block", [
    ("document(sizes=[40,50,38]) & window(20)", {}, 16), ("causal | blocks(-1,-1,0,0,0,-1)", {}, 2),
    ("causal", {"length": 64}, 16), ("window(5)", {"offset": 30, "length": 17, "kv_start": 20}, 8),
    ("causal", {"length": 32, "lengths": "32,20"}, 16),
])
def test_flex_block_mask_and_mask_mod_run_the_mask(expr, flags, block):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    m = build(expr, **flags)
    result = flex.to(m, block)
    t = {name: torch.from_numpy(value) for name, value in result.tensors.items()}
    code = "\n".join(result.code)
    mask_mod = None
    if "mask_mod=mask_mod" in code:
        from maskcli import build as rebuild  # the call the export prints, run as printed

        mask_mod = eval(re.search(r"mask_mod = (build\(.*\))\.local_mask_mod\(q\.device\)", code).group(1), {"build": rebuild}).mask_mod
    block_mask = BlockMask.from_kv_blocks(t["kv_num_blocks"], t["kv_indices"], t["full_kv_num_blocks"], t["full_kv_indices"],
                                          BLOCK_SIZE=(block, block), mask_mod=mask_mod, seq_lengths=(m.frame.q_len, m.frame.k_len))
    q, k, v = inputs(m.batch, 1, m.frame.q_len, m.frame.k_len)
    out = flex_attention(q, k, v, block_mask=block_mask)
    keep = m.dense()
    seen = seen_rows(keep)[..., None] & torch.ones_like(out, dtype=torch.bool)
    assert torch.allclose(out[seen], reference_attention(q, k, v, keep)[seen], atol=1e-5)


def test_flex_build_call_keeps_ids_heads_and_a_region():
    """The printed build(...) carries ids, heads and a --rows/--keys region: its mask_mod, evaluated by FlexAttention's
    create_mask, is local(3) with ids padding over queries 2-3 and keys 1-4, by a loop (chunks counted from each
    row's first real token, as transformers' chunked_overlay counts them, masking_utils.py:102-111)."""
    from torch.nn.attention.flex_attention import create_mask

    from maskcli import build as rebuild

    m = rebuild("local(3)", length=6, rows="2:4", keys="1:5", ids="1,2,3,4,5,6;0,0,3,4,5,6", heads=2)
    call = flex.build_call(m)
    assert "rows='2:4', keys='1:5'" in call and "heads=2" in call
    pads = [0, 2]
    want = torch.tensor([[[[kv >= pads[b] and kv <= q and (q - pads[b]) // 3 == (kv - pads[b]) // 3 for kv in range(1, 5)] for q in range(2, 4)]]
                         for b in range(2)])
    printed = create_mask(eval(call, {"build": rebuild}).mask_mod, 2, 2, 2, 4, device="cpu")
    assert torch.equal(printed, want.expand(2, 2, 2, 4))


def test_flex_without_partial_blocks_needs_no_mask_mod():
    result = flex.to(build("segment(sizes=[16,32])"), 16)
    assert "mask_mod" not in "\n".join(result.code).split("from_kv_blocks")[1]


# --- 1M tokens, O(L) -------------------------------------------------------------------------------


def test_a_million_token_document_and_window_mask_in_the_o_of_l_formats():
    m = build("document(sizes=[300000,700000]) & window(4096)", length=1_000_000)
    t = flash_attn.to(m).tensors
    assert t["cu_seqlens_q"].tolist() == [0, 300000, 1_000_000]
    indices = flashmask.to(m).tensors["startend_row_indices"]
    j = np.arange(1_000_000)
    assert np.array_equal(indices[0, 0, :, 0], np.minimum(j + 4096, np.where(j < 300000, 300000, 1_000_000)))
    ranges = magi.to(m).tensors
    assert ranges["attn_type_map"].tolist() == [1, 3, 1, 3]
    assert ranges["q_ranges"].tolist() == [[0, 4096], [4096, 300000], [300000, 304096], [304096, 1_000_000]]


# --- reading the formats back (--from) against the same documented rules ----------------------------


@pytest.mark.parametrize("seed", range(12))
def test_flash_attn_read_is_the_documented_rule(seed):
    g = np.random.default_rng(seed)
    q_lens = g.integers(1, 6, size=g.integers(1, 4))
    k_lens = q_lens if seed % 2 else q_lens + g.integers(0, 3, size=q_lens.size)
    causal = bool(g.integers(0, 2))
    window = (int(g.integers(-1, 4)), -1 if causal else int(g.integers(-1, 3)))
    tensors = {"cu_seqlens_q": flash_attn.cu_seqlens(q_lens), "cu_seqlens_k": flash_attn.cu_seqlens(k_lens),
               "causal": np.array(causal), "window_size": np.array(window)}
    m = flash_attn.read({k: torch.from_numpy(v) for k, v in tensors.items()}, {})
    want = flash_reference(tensors["cu_seqlens_q"].tolist(), tensors["cu_seqlens_k"].tolist(), causal, window)
    assert np.array_equal(m.dense()[0, 0], want)


@pytest.mark.parametrize("seed", range(12))
def test_flashmask_read_is_paddles_reference(seed):
    g = np.random.default_rng(seed)
    length, causal = int(g.integers(2, 10)), bool(seed % 2)
    bounds = [1, 2][seed % 4 // 2] if causal else [2, 4][seed % 4 // 2]
    j = np.arange(length)
    lts = j + g.integers(0, length, size=length)
    columns = [np.minimum(lts, length)]
    if bounds >= 2 and causal or bounds == 4:
        columns.append(np.minimum(columns[0] + g.integers(0, length, size=length), length))
    if not causal:
        ute = j - g.integers(0, length, size=length)
        if bounds == 4:
            uts = np.maximum(ute - g.integers(0, length, size=length), 0)
            columns += [np.minimum(uts, j), np.clip(ute, 0, j)]
        else:
            columns.append(np.clip(ute, 0, j))
    indices = np.stack(columns, -1)[None, None].astype(np.int32)
    m = flashmask.read({"startend_row_indices": torch.from_numpy(indices), "causal": torch.tensor(causal)}, {})
    assert np.array_equal(m.dense()[:, 0], flashmask_reference(indices, causal))


@pytest.mark.parametrize("seed", range(12))
def test_magi_read_is_the_documented_rule(seed):
    g = np.random.default_rng(seed)
    total_q, total_k, n = int(g.integers(2, 10)), int(g.integers(2, 10)), int(g.integers(1, 5))
    qs = g.integers(0, total_q, size=n)
    ks = g.integers(0, total_k, size=n)
    q_ranges = np.stack([qs, qs + g.integers(1, total_q - qs + 1)], -1)
    k_ranges = np.stack([ks, ks + g.integers(1, total_k - ks + 1)], -1)
    types = g.integers(0, 4, size=n)
    tensors = {"q_ranges": q_ranges, "k_ranges": k_ranges, "attn_type_map": types,
               "total_seqlen_q": np.array(total_q), "total_seqlen_k": np.array(total_k)}
    m = magi.read({k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}, {})
    assert np.array_equal(m.dense()[0, 0], magi_reference(q_ranges, k_ranges, types, total_q, total_k))


# --- random expressions (tests/strategies.py): every format either holds the mask exactly or refuses ---------


from hypothesis import HealthCheck, given, settings  # noqa: E402

import definitions as ref  # noqa: E402
from maskcli.errors import MaskError  # noqa: E402
from strategies import cases, expected_cells  # noqa: E402


def built_case(case):
    tree, options, frame, valid = case
    try:
        m = build(ref.text(tree), **{key: value for key, value in options.items() if value is not None})
    except MaskError:
        return None, None
    return m, expected_cells(tree, options, frame, valid, m.batch)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_random_masks_in_magi_and_flashmask_are_the_reference_cells_or_refused(case):
    m, cells = built_case(case)
    if m is None or not m.exact:
        return
    batch, lq, lk = cells.shape
    t = magi.to(m).tensors
    packed_cells = np.zeros((batch * lq, batch * lk), dtype=bool)
    for b in range(batch):
        packed_cells[b * lq:(b + 1) * lq, b * lk:(b + 1) * lk] = cells[b]
    assert np.array_equal(magi_reference(t["q_ranges"], t["k_ranges"], t["attn_type_map"], batch * lq, batch * lk), packed_cells)
    back = magi.read({k: torch.from_numpy(np.asarray(v)) for k, v in t.items()}, {})
    assert np.array_equal(back.dense()[0, 0], packed_cells)
    try:
        fm = flashmask.to(m).tensors
    except CannotHold as why:
        assert "square" in str(why) or "separate runs" in str(why) or "not few" in str(why), why
        return
    assert np.array_equal(flashmask_reference(fm["startend_row_indices"], bool(fm["causal"])), cells)
    back = flashmask.read({k: torch.from_numpy(np.asarray(v)) for k, v in fm.items()}, {})
    assert np.array_equal(back.dense()[:, 0], cells)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_random_masks_in_flash_attn_are_the_reference_cells_or_refused(case):
    m, cells = built_case(case)
    if m is None or not m.exact:
        return
    try:
        result = flash_attn.to(m)
    except CannotHold as why:
        assert "cannot express" in str(why), why
        return
    t = result.tensors
    code = "\n".join(result.code)
    window = tuple(t["window_size"].tolist())
    if "cache_seqlens" in t:
        got = kvcache_reference(t["cache_seqlens"].tolist(), t["cache_leftpad"].tolist(), int(t["seqlen_q"]), "causal=True" in code, window)
        assert np.array_equal(got, cells)
        return
    got = flash_reference(t["cu_seqlens_q"].tolist(), t["cu_seqlens_k"].tolist(), "causal=True" in code, window)
    f = m.frame
    if not f.padded:  # every batch row whole, one after another
        batch, lq, lk = cells.shape
        expected = np.zeros((batch * lq, batch * lk), dtype=bool)
        for b in range(batch):
            expected[b * lq:(b + 1) * lq, b * lk:(b + 1) * lk] = cells[b]
        assert np.array_equal(got, expected)
        return
    at = seen = 0
    for b in range(m.batch):  # each batch row's real tokens, packed: the rows of padding queries are left out
        valid = f.key_valid[b if f.key_valid.shape[0] > 1 else 0]
        real = np.flatnonzero(valid[f.q_start:f.q_end])
        if real.size == 0:
            continue
        block = cells[b][np.ix_(real, real + f.q_start - f.k_start)]
        assert np.array_equal(got[at:at + real.size, at:at + real.size], block)
        at, seen = at + real.size, seen + int(block.sum())
    assert got.sum() == seen  # nothing across sequences


# hunt 9a: a 0-d cu_seqlens (IndexError), an empty cache_seqlens (ValueError) and sequences of no tokens (a mask of
# 0 queries or 0 keys shown, exit 0) are each one line naming the field
@pytest.mark.parametrize("tensors, says", [
    ({"cu_seqlens": 5}, "cu_seqlens_q must be 0 then rising totals, like [0, 3, 8]; got [5] (shape [])"),
    ({"cu_seqlens_q": [0, 0, 0], "cu_seqlens_k": [0, 3, 5]}, "cu_seqlens_q [0, 0, 0] ends at 0: the sequences hold no tokens"),
    ({"cu_seqlens_q": [0, 3, 5], "cu_seqlens_k": [0, 0, 0]}, "cu_seqlens_k [0, 0, 0] ends at 0: the sequences hold no tokens"),
    ({"cache_seqlens": np.zeros(0, np.int64), "seqlen_q": 1}, "cache_seqlens [] holds no key in any batch row"),
    ({"cache_seqlens": [0, 0], "seqlen_q": 1, "causal": 1}, "cache_seqlens [0, 0] holds no key in any batch row"),
])
def test_flash_attn_read_refuses_a_file_of_no_tokens_in_one_line(tensors, says):
    from maskcli.errors import MaskError

    with pytest.raises(MaskError) as raised:
        flash_attn.read({k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}, {})
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_magi_read_refuses_a_0d_attn_type_map_in_one_line():
    from maskcli.errors import MaskError

    tensors = {"q_ranges": torch.tensor([[0, 4]]), "k_ranges": torch.tensor([[0, 4]]), "attn_type_map": torch.tensor(1)}
    with pytest.raises(MaskError, match=re.escape("q_ranges and k_ranges must be (N, 2) and attn_type_map (N,); got [1, 2], [1, 2], []")):
        magi.read(tensors, {})  # was "unexpected TypeError: len() of unsized object"


def _flex_file(**over) -> dict:
    tensors = {"kv_num_blocks": torch.zeros(1, 1, 1, dtype=torch.int32), "kv_indices": torch.zeros(1, 1, 1, 1, dtype=torch.int32),
               "full_kv_num_blocks": torch.ones(1, 1, 1, dtype=torch.int32), "full_kv_indices": torch.zeros(1, 1, 1, 1, dtype=torch.int32),
               "block_size": torch.tensor([128, 128]), "seq_lengths": torch.tensor([8, 8])}
    return {**tensors, **over}


# hunt 9a: seq_lengths or block_size of the wrong length, no batch row or head (unpacking, broadcast, IndexError and
# max() errors), and a block far longer than the mask (a repeat by 2^62 rows: "array is too big")
@pytest.mark.parametrize("over, says", [
    ({"seq_lengths": torch.tensor([8])}, "block_size is one or two numbers and seq_lengths two (queries, keys); got [128, 128] and [8]"),
    ({"seq_lengths": torch.tensor([8, 8, 8])}, "got [128, 128] and [8, 8, 8]"),
    ({"block_size": torch.tensor([128, 128, 1])}, "got [128, 128, 1] and [8, 8]"),
    ({"kv_num_blocks": torch.zeros(0, 1, 1, dtype=torch.int32), "full_kv_num_blocks": torch.zeros(0, 1, 1, dtype=torch.int32),
      "full_kv_indices": torch.zeros(0, 1, 1, 1, dtype=torch.int32)}, "full_kv_indices has shape [0, 1, 1, 1]: no batch row or no head"),
    ({"kv_num_blocks": torch.zeros(1, 0, 1, dtype=torch.int32), "full_kv_num_blocks": torch.zeros(1, 0, 1, dtype=torch.int32),
      "full_kv_indices": torch.zeros(1, 0, 1, 1, dtype=torch.int32)}, "full_kv_indices has shape [1, 0, 1, 1]: no batch row or no head"),
])
def test_flex_read_refuses_sizes_and_shapes_it_cannot_read_in_one_line(over, says):
    from maskcli.errors import MaskError

    with pytest.raises(MaskError, match=re.escape(says)):
        flex.read(_flex_file(**over), {})


def test_flex_read_of_a_block_far_longer_than_the_mask_is_the_mask():
    m = flex.read(_flex_file(block_size=torch.tensor([2**62, 2**62])), {})
    assert m.dense().all() and m.dense().shape == (1, 1, 8, 8)


def test_a_bool_index_tensor_is_refused_as_a_float_one_is():
    """hunt 9a: cu_seqlens [False, True, True] was read as [0, 1, 1], a mask of one cell with exit 0; flash_attn
    refuses any cu_seqlens that is not int32."""
    from maskcli.errors import MaskError

    with pytest.raises(MaskError, match=re.escape("cu_seqlens is a bool tensor ([False, True, True]); the library takes integers (int32)")):
        flash_attn.read({"cu_seqlens": torch.tensor([False, True, True])}, {})
    with pytest.raises(MaskError, match="block_size is a bool tensor"):
        flex.read(_flex_file(block_size=torch.tensor([True, True]), seq_lengths=torch.tensor([1, 1])), {})
