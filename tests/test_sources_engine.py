"""sources/engine.py: each request's Mask in an engine's batch metadata, made from its kinds at its positions, checked
against a double loop over absolute positions built here from the metadata's own fields (query_start_loc, seq_lens,
the window, the cascade's prefix, the draft tree's parents)."""

from __future__ import annotations

import numpy as np
import pytest
from serve_builders import Req, allocate, ancestors, flash_attn, vllm, with_tree

from maskcli.errors import MaskError
from maskcli.mask import build
from maskcli.serve.engines import from_tensors
from maskcli.sources import engine, registry


def request_cells(q_indptr, seq_lens, r, allowed) -> np.ndarray:
    """Request r's (queries, keys) keep cells by a double loop: its queries sit at seq_len - q_len .. seq_len - 1 (the
    last query faces the last key), its keys at 0 .. seq_len - 1, and `allowed(q, k)` says what its kind keeps."""
    q_len, seq = int(q_indptr[r + 1] - q_indptr[r]), int(seq_lens[r])
    first = seq - q_len
    return np.array([[allowed(first + i, k) for k in range(seq)] for i in range(q_len)], bool).reshape(q_len, seq)


def check_every_request(fields: dict, q_indptr, seq_lens, allowed) -> list:
    masks = engine.masks(from_tensors(fields, "test"))
    assert len(masks) == len(seq_lens)
    for r, mask in enumerate(masks):
        want = request_cells(q_indptr, seq_lens, r, allowed)
        assert (mask.frame.q_start, mask.frame.q_len, mask.frame.k_start, mask.frame.k_len) == (
            int(seq_lens[r]) - want.shape[0], want.shape[0], 0, int(seq_lens[r]))
        assert np.array_equal(mask.dense()[0, 0], want), r
    return masks


def test_vllm_requests_are_bottom_right_causal():
    reqs = allocate([Req(5, 3), Req(0, 6), Req(9, 1)], 4)
    f = vllm(reqs, 4)
    masks = check_every_request(f, f["query_start_loc"], f["seq_lens"], lambda q, k: k <= q)
    assert [m.text for m in masks] == ["causal"] * 3


def test_a_sliding_window_keeps_the_last_w_keys_including_self():
    reqs = allocate([Req(7, 4), Req(2, 2)], 4)
    f = flash_attn(reqs, 4, window_size=np.array([2, 0]))  # window_size=(W-1, 0): W = 3 keys
    masks = check_every_request(f, f["cu_seqlens_q"], f["seqused_k"], lambda q, k: q - 3 < k <= q)
    assert masks[0].text == "window(3)"


def test_a_cascade_prefix_is_seen_by_every_query():
    reqs = allocate([Req(8, 2), Req(8, 3)], 4, shared=2)
    f = vllm(reqs, 4, common_prefix_len=np.array(8), cu_prefix_query_lens=np.array([0, 5]),
             prefix_kv_lens=np.array([8]), suffix_kv_lens=np.array([2, 3]))
    masks = check_every_request(f, f["query_start_loc"], f["seq_lens"], lambda q, k: k <= q or k < 8)
    assert masks[1].text == "prefix(8)"


def test_a_draft_tree_sees_the_prefix_its_ancestors_and_itself():
    parents = [-1, 0, 0, 1, 1, 2]
    reqs = allocate([Req(3, 2), Req(5, len(parents))], 4)
    f = with_tree("flashinfer", reqs, 4, parents)
    up = ancestors(parents)  # up[i, j]: draft j is node i's ancestor or itself, read off the parents by a loop

    def allowed_for(r):
        seq, n = int(reqs[r].seq), reqs[r].new
        return lambda q, k: k <= q if r == 0 else (k < seq - n or bool(up[q - (seq - n), k - (seq - n)]))

    masks = engine.masks(from_tensors(f, "test"))
    for r, mask in enumerate(masks):
        want = request_cells(f["qo_indptr"], [q.seq for q in reqs], r, allowed_for(r))
        assert np.array_equal(mask.dense()[0, 0], want), r
    assert masks[1].text == "tree(-1,0,0,1,1,2)"


def test_each_mask_is_the_mask_its_shown_expression_builds():
    """The expression is only the request's name; read back, it must name the same mask at the same positions."""
    reqs = allocate([Req(6, 3), Req(0, 4), Req(11, 2)], 4, shared=1)
    for fields in (vllm(reqs, 4, sliding_window=np.array(4)), vllm(reqs, 4, attention_chunk_size=np.array(4)),
                   {**flash_attn(reqs, 4), "causal": 0}, with_tree("flashinfer", reqs, 4, [-1, 0, 0])):
        b = from_tensors(fields, "test")
        for r, mask in enumerate(engine.masks(b)):
            q_start, q_len, seq = b.frame(r)
            text = b.expression(r)
            assert mask.text == text
            assert np.array_equal(mask.dense(), build(text, offset=q_start, length=q_len, kv_len=seq).dense()), (text, r)


def test_a_request_with_no_frame_or_no_queries_has_no_mask():
    f = {"cu_seqlens_q": np.array([0, 3, 3, 5]), "seqused_k": np.array([2, 4, 0]), "causal": 1}
    assert engine.masks(from_tensors(f, "test")) == [None, None, None]  # 3 queries for 2 keys; no queries; no keys


def test_the_registry_reads_a_metadata_file_and_loads_every_request(tmp_path):
    path = tmp_path / "batch.npz"
    np.savez(path, cu_seqlens_q=np.array([0, 1, 3]), seqused_k=np.array([5, 4]), causal=np.array(1))
    batch = registry.read("engine", str(path))
    assert batch.engine == "flash_attn" and batch.requests == 2
    masks = registry.sources()["engine"].load(str(path))
    assert np.array_equal(masks[1].dense()[0, 0], request_cells([0, 1, 3], [5, 4], 1, lambda q, k: k <= q))


def test_a_file_of_no_engine_is_one_clear_error(tmp_path):
    path = tmp_path / "x.npz"
    np.savez(path, foo=np.zeros(3))
    with pytest.raises(MaskError, match="none of them an engine's batch metadata names"):
        engine.load(str(path))
