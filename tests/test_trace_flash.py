"""maskcli.trace.flash: flash_attn's calls captured, against a stand-in flash_attn written here.

flash_attn needs CUDA, so a tiny `flash_attn` package is written to a folder on sys.path: its functions
take flash_attn's documented arguments in its (B, L, H, D) layout and compute attention on the CPU through
a mask built by a double loop over positions from flash_attn_interface.py's docstrings (queries aligned
bottom-right, window [i + Lk - Lq - left, i + Lk - Lq + right], -1 unbounded). Each traced mask must equal
that mask cell for cell, and the outputs must be what they are untraced.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest
import torch

import maskcli

STAND_IN = '''
"""A stand-in for flash_attn on the CPU (maskcli's tests): flash_attn's documented masks by a double loop."""
import torch


def reference_keep(nq, nk, causal=False, window_size=(-1, -1)):
    left, right = window_size
    keep = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        at = i + nk - nq
        for j in range(nk):
            seen = not (causal and j > at)
            if left >= 0 and j < at - left:
                seen = False
            if right >= 0 and j > at + right:
                seen = False
            keep[i, j] = seen
    return keep


def _attend(q, k, v, keep, scale):
    """q (Lq, H, D), k and v (Lk, Hk, D): the output (Lq, H, D), rows that see no key 0 (as flash_attn gives)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", weights, v)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    keep = reference_keep(q.shape[1], k.shape[1], causal, window_size)
    return torch.stack([_attend(q[b], k[b], v[b], keep, softmax_scale) for b in range(q.shape[0])])


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    out = torch.zeros_like(q)
    for s in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
        keep = reference_keep(q1 - q0, k1 - k0, causal, window_size)
        out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], keep, softmax_scale)
    return out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        used = int(cache_seqlens[b]) if cache_seqlens is not None else k_cache.shape[1]
        if k is not None:  # the new keys go into the cache in place, after the ones it holds
            k_cache[b, used:used + k.shape[1]] = k[b]
            v_cache[b, used:used + k.shape[1]] = v[b]
            used += k.shape[1]
        start = int(cache_leftpad[b]) if cache_leftpad is not None else 0
        keep = reference_keep(q.shape[1], used - start, causal, window_size)
        out[b] = _attend(q[b], k_cache[b, start:used], v_cache[b, start:used], keep, softmax_scale)
    return out
'''


@pytest.fixture
def flash_attn(tmp_path, monkeypatch):
    """The stand-in package on sys.path, imported (and forgotten again after the test)."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "flash_attn_interface.py").write_text(STAND_IN)
    (package / "__init__.py").write_text("from flash_attn.flash_attn_interface import *  # noqa: F401,F403\n"
                                         "from flash_attn.flash_attn_interface import reference_keep, _attend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module("flash_attn")
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        sys.modules.pop(name, None)


def blocks(sequences: list[tuple[int, int, int, int]], q_len: int, k_len: int, causal: bool, window_size) -> np.ndarray:
    """The packed (total_q, total_k) mask: each sequence's (q0, q1, k0, k1) block its own mask, nothing between."""
    from flash_attn import reference_keep

    keep = np.zeros((q_len, k_len), dtype=bool)
    for q0, q1, k0, k1 in sequences:
        keep[q0:q1, k0:k1] = reference_keep(q1 - q0, k1 - k0, causal, window_size).numpy()
    return keep


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("causal, window_size", [(True, (-1, -1)), (False, (2, 1)), (True, (3, 0)), (False, (-1, 0)), (False, (1, -1))])
def test_batched_calls_with_fewer_queries_than_keys_are_bottom_right(flash_attn, causal, window_size):
    q, k, v = randn(2, 3, 4, 8), randn(2, 7, 2, 8, seed=1), randn(2, 7, 2, 8, seed=2)
    untraced = flash_attn.flash_attn_func(q, k, v, causal=causal, window_size=window_size)
    with maskcli.trace() as t:
        traced = flash_attn.flash_attn_func(q, k, v, causal=causal, window_size=window_size)
    assert torch.equal(traced, untraced)
    (call,) = t.calls  # the stand-in's own softmax is inside the flash call: not another call
    assert call.api == "flash" and call.shape == (2, 4, 3, 7) and call.details["causal"] is causal
    want = flash_attn.reference_keep(3, 7, causal, window_size).numpy()
    assert np.array_equal(call.keep(), np.broadcast_to(want, (2, 4, 3, 7)))
    assert call.stored["form"] == "intervals"


def test_packed_qkv_and_kv_and_a_causal_call_with_more_queries_than_keys(flash_attn):
    qkv = randn(1, 5, 3, 2, 8)
    q, kv = randn(1, 6, 2, 8), randn(1, 4, 2, 2, 8, seed=3)
    with maskcli.trace() as t:
        flash_attn.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(1, -1))
        out = flash_attn.flash_attn_kvpacked_func(q, kv, causal=True)
    first, second = t.calls
    assert [c.details["function"] for c in t.calls] == ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"]
    assert np.array_equal(first.keep()[0, 0], flash_attn.reference_keep(5, 5, True, (1, -1)).numpy())
    assert second.shape == (1, 2, 6, 4)
    assert np.array_equal(second.keep()[0, 1], flash_attn.reference_keep(6, 4, True).numpy())  # its first 2 rows see nothing
    assert torch.equal(out[0, :2], torch.zeros(2, 2, 8))
    (g1, g2) = t.groups()
    assert any(f.code == "fully-masked" and "FlashAttention" in f.message for f in g2.findings)


def test_varlen_with_several_documents_is_a_document_mask(flash_attn):
    lengths = [3, 5, 2, 6]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = int(cu[-1])
    q, k, v = randn(total, 2, 8), randn(total, 2, 8, seed=1), randn(total, 2, 8, seed=2)
    untraced = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    with maskcli.trace() as t:
        traced = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, window_size=(1, 0))
    assert torch.equal(traced, untraced)
    sequences = [(int(cu[s]), int(cu[s + 1]), int(cu[s]), int(cu[s + 1])) for s in range(len(lengths))]
    causal, windowed = t.calls
    assert causal.shape == (1, 2, total, total) and causal.details["cu_seqlens_q"] == cu.tolist()
    assert np.array_equal(causal.keep()[0, 0], blocks(sequences, total, total, True, (-1, -1)))
    assert np.array_equal(windowed.keep()[0, 1], blocks(sequences, total, total, True, (1, 0)))
    names = [group.name for group in t.groups()]
    labels = ",".join(str(s) for s, n in enumerate(lengths) for _ in range(n))
    assert names[0] == f"document({labels})"
    assert names[1] == f"document({labels}) & window(2)"  # window_size (1, 0): itself and one key before


def test_varlen_queries_fewer_than_keys_per_sequence_and_packed_qkv(flash_attn):
    cu_q = torch.tensor([0, 2, 3, 6], dtype=torch.int32)  # a chunked prefill: each sequence's last queries
    cu_k = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    q, k, v = randn(6, 2, 8), randn(12, 1, 8, seed=1), randn(12, 1, 8, seed=2)
    qkv = randn(9, 3, 2, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with maskcli.trace() as t:
        flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True, window_size=(2, 0))
        flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=False, window_size=(1, 1))
    first, second = t.calls
    spans = [(int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])) for s in range(3)]
    assert np.array_equal(first.keep()[0, 0], blocks(spans, 6, 12, True, (2, 0)))
    assert np.array_equal(second.keep()[0, 0], blocks([(0, 4, 0, 4), (4, 9, 4, 9)], 9, 9, False, (1, 1)))


def test_kvcache_with_cache_seqlens_new_keys_and_left_padding(flash_attn):
    batch, slots = 3, 10
    cache_k, cache_v = randn(batch, slots, 2, 8, seed=1), randn(batch, slots, 2, 8, seed=2)
    lengths = torch.tensor([4, 7, 2], dtype=torch.int32)
    leftpad = torch.tensor([0, 2, 1], dtype=torch.int32)
    q, k, v = randn(batch, 2, 2, 8), randn(batch, 2, 2, 8, seed=3), randn(batch, 2, 2, 8, seed=4)
    untraced = flash_attn.flash_attn_with_kvcache(q, cache_k.clone(), cache_v.clone(), k, v, cache_seqlens=lengths,
                                                  cache_leftpad=leftpad, causal=True, window_size=(3, 0))
    with maskcli.trace() as t:
        traced = flash_attn.flash_attn_with_kvcache(q, cache_k, cache_v, k, v, cache_seqlens=lengths, cache_leftpad=leftpad,
                                                    causal=True, window_size=(3, 0))
    assert torch.equal(traced, untraced)
    (call,) = t.calls
    assert call.shape == (batch, 2, 2, slots) and call.details["cache_seqlens"] == [4, 7, 2] and call.details["new_keys"] == 2
    keep = call.keep()
    for b in range(batch):
        used, start = int(lengths[b]) + 2, int(leftpad[b])
        want = np.zeros((2, slots), dtype=bool)
        want[:, start:used] = flash_attn.reference_keep(2, used - start, True, (3, 0)).numpy()
        assert np.array_equal(keep[b, 0], want) and np.array_equal(keep[b, 1], want)


def test_a_long_varlen_call_is_stored_as_intervals_without_l_by_l_cells(flash_attn):
    """A million packed tokens in 1,000 documents: read in O(L), one interval a row, exact on a few rows."""
    lengths = np.full(1000, 1000)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    from maskcli.trace.flash import read

    seen = read("flash_attn_varlen_func", {"q": torch.empty(1, 1, 8).expand(1_000_000, 1, 8), "k": torch.empty(1, 1, 8).expand(1_000_000, 1, 8),
                                           "v": torch.empty(1, 1, 8).expand(1_000_000, 1, 8), "cu_seqlens_q": cu, "cu_seqlens_k": cu,
                                           "max_seqlen_q": 1000, "max_seqlen_k": 1000, "causal": True, "window_size": (99, 0)})
    found = seen.intervals
    assert found.per_row == 1 and seen.shape == (1, 1, 1_000_000, 1_000_000)
    for row in (0, 5, 999, 1000, 1001, 123_456, 999_999):
        start = row - row % 1000
        assert found.row(0, row) == [(max(start, row - 99), row + 1)]


def test_a_program_that_imports_flash_attn_while_traced_is_seen(flash_attn, tmp_path, monkeypatch):
    """The program imports flash_attn only once the trace has begun (an import hook swaps its functions then)."""
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        sys.modules.pop(name, None)
    script = tmp_path / "uses_flash.py"
    script.write_text(textwrap.dedent("""
        import torch
        from flash_attn import flash_attn_varlen_func
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        q = torch.randn(5, 2, 8)
        print(flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, causal=True).shape)
    """))
    from typer.testing import CliRunner

    from maskcli.commands import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["trace", str(script)])
    assert result.exit_code == 0, result.output
    assert "torch.Size([5, 2, 8])" in result.stdout
    assert "0  uses_flash.py:6  flash  prefill  (1,2,5,5)  document(0,0,1,1,1)" in result.stderr  # one packed call
    from flash_attn import flash_attn_varlen_func

    assert flash_attn_varlen_func.__code__.co_name == "flash_attn_varlen_func" and "_maskcli" not in " ".join(flash_attn_varlen_func.__code__.co_names)


def test_while_swapped_the_functions_keep_their_signatures_and_api_flash_can_be_left_out(flash_attn):
    import inspect

    before = inspect.signature(flash_attn.flash_attn_varlen_func)
    q = randn(1, 3, 1, 8)
    with maskcli.trace(apis=("sdpa", "softmax")) as t:
        flash_attn.flash_attn_func(q, q, q, causal=True)
    assert [c.api for c in t.calls] == ["softmax"]  # flash left out: the stand-in's own softmax is what is seen
    with maskcli.trace():
        assert inspect.signature(flash_attn.flash_attn_varlen_func) == before  # HF reads them to choose its arguments
    assert inspect.signature(flash_attn.flash_attn_varlen_func) == before


def test_a_long_varlen_call_is_named_by_its_documents_on_intervals(flash_attn, monkeypatch):
    import maskcli.trace.report as report

    monkeypatch.setattr(report, "NAME_CELLS", 16)  # every mask here counts as too long to rebuild cell by cell
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    q = randn(10, 1, 8)
    with maskcli.trace() as t:
        flash_attn.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=True)
        flash_attn.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=True, window_size=(1, 0))
        flash_attn.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=False)  # segments: no document(...) rebuilds it
    names = [group.name for group in t.groups()]
    assert names[:2] == ["document(sizes=[3,5,2])", "document(sizes=[3,5,2]) & window(2)"]
    assert names[2].startswith("not named")


from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(nq=st.integers(1, 9), nk=st.integers(1, 9), causal=st.booleans(), left=st.integers(-1, 10), right=st.integers(-1, 10))
def test_the_intervals_of_any_batched_call_are_the_documented_mask(nq, nk, causal, left, right):
    """Every shape, causal or not, every window: the intervals against the docstrings' rule, a double loop (the
    kernel reads a bound of Lk or more as none, which the rule agrees with except for a right bound of Lk or more
    with more queries than that: left out)."""
    assume(not (right >= nk and right < nq - 1))
    from maskcli.trace.flash import read

    q, k = torch.zeros(1, nq, 1, 4), torch.zeros(1, nk, 1, 4)
    seen = read("flash_attn_func", {"q": q, "k": k, "v": k, "causal": causal, "window_size": (left, right)})
    got = seen.intervals.dense(0, 0, nq)
    for i in range(nq):
        at = i + nk - nq
        for j in range(nk):
            want = not (causal and j > at) and not (left >= 0 and j < at - left) and not (right >= 0 and j > at + right)
            assert got[i, j] == want, (i, j)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), causal=st.booleans(), left=st.integers(-1, 4), right=st.integers(-1, 4))
def test_varlen_intervals_are_each_sequences_own_mask_and_nothing_across(data, causal, left, right):
    from maskcli.trace.flash import read

    pairs = data.draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=4))
    cu_q = np.concatenate([[0], np.cumsum([p[0] for p in pairs])])
    cu_k = np.concatenate([[0], np.cumsum([p[1] for p in pairs])])
    total_q, total_k = int(cu_q[-1]) + 1, int(cu_k[-1])  # one row past the sequences: it sees nothing
    assume(total_k > 0)
    max_k = max(p[1] for p in pairs)
    assume(not (right >= max_k and any(right < nq - 1 for nq, _ in pairs)))
    seen = read("flash_attn_varlen_func", {"q": torch.zeros(total_q, 1, 4), "k": torch.zeros(total_k, 1, 4), "v": torch.zeros(total_k, 1, 4),
                                           "cu_seqlens_q": torch.tensor(cu_q), "cu_seqlens_k": torch.tensor(cu_k),
                                           "max_seqlen_q": 5, "max_seqlen_k": max_k, "causal": causal, "window_size": (left, right)})
    got = seen.intervals.dense(0, 0, total_q)
    want = np.zeros((total_q, total_k), dtype=bool)
    for s, (nq, nk) in enumerate(pairs):
        for i in range(nq):
            at = i + nk - nq
            for j in range(nk):
                want[cu_q[s] + i, cu_k[s] + j] = (not (causal and j > at) and not (left >= 0 and j < at - left)
                                                  and not (right >= 0 and j > at + right))
    assert np.array_equal(got, want)


def test_seqused_q_and_k_cut_each_sequence_to_its_first_positions():
    """FlashAttention 3's varlen: a sequence's slot in cu_seqlens, of which it uses seqused_q queries and seqused_k
    keys (the rest of the slot is neither attended nor attending)."""
    from maskcli.trace.flash import read

    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    used_q, used_k = torch.tensor([3, 6], dtype=torch.int32), torch.tensor([2, 5], dtype=torch.int32)
    seen = read("flash_attn_varlen_func", {"q": torch.zeros(10, 1, 4), "k": torch.zeros(10, 1, 4), "v": torch.zeros(10, 1, 4),
                                           "cu_seqlens_q": cu, "cu_seqlens_k": cu, "seqused_q": used_q, "seqused_k": used_k,
                                           "max_seqlen_q": 6, "max_seqlen_k": 6, "causal": True})
    want = np.zeros((10, 10), dtype=bool)
    for s in range(2):
        nq, nk = int(used_q[s]), int(used_k[s])
        for i in range(nq):
            for j in range(nk):
                want[int(cu[s]) + i, int(cu[s]) + j] = j <= i + nk - nq
    assert np.array_equal(seen.intervals.dense(0, 0, 10), want) and seen.details["seqused_k"] == [2, 5]
