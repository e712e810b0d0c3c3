"""checks/repeated.py: two real tokens of one sequence at the same multimodal rope ids, the later seeing the earlier
(a rope index handed a mask other than the batch's padding)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug, first, traced
from maskcli.checks.repeated import _pairs, ids_padding

REPEATED = Path(__file__).parent / "data" / "repeated"


def _reference(seen, ids, real, restart):
    """A triple loop: query q sees key k < q, both real, no restart between, the same ids in every row."""
    bad = np.zeros(seen.shape, dtype=bool)
    for b in range(seen.shape[0]):
        for q in range(seen.shape[1]):
            for k in range(q):
                bad[b, q, k] = seen[b, q, k] and real[b, q] and real[b, k] and restart[b, q] == restart[b, k] \
                    and all(ids[c, b, q] == ids[c, b, k] for c in range(ids.shape[0]))
    return bad


def test_pairs_against_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(30):
        rows, n = 2, 9
        ids = rng.integers(0, 3, size=(3, rows, n))
        seen = rng.random((rows, n, n)) < 0.7
        real = rng.random((rows, n)) < 0.8
        restart = np.cumsum(rng.random((rows, n)) < 0.2, axis=1)
        got = _pairs(seen, ids, real, restart)
        want = _reference(seen, ids, real, restart)
        assert got == (None if not want.any() else (tuple(int(i) for i in np.argwhere(want)[0]), int(want.sum())))


def test_ids_padding_reads_a_batch_padded_to_a_bucket():
    tokens = np.array([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]])  # every row padded, runs of 2 and 3
    assert ids_padding(tokens).tolist() == [[True] * 3 + [False] * 2, [True] * 2 + [False] * 3]
    assert ids_padding(np.array([[5, 6, 0, 0], [8, 0, 9, 0]])) is None  # the pad id is text too: no padding
    assert ids_padding(np.array([[5, 6, 0, 0], [8, 9, 0, 0]])) is None  # runs of one length: a span of one id


def test_pai_megatron_rope_index_given_the_pads_mask(tmp_path):
    """alibaba/Pai-Megatron-Patch#448 (fix #449, d015261; written blind, batch blind-dy): get_ltor_masks_and_position_ids
    hands get_rope_index `target == pad_token`, so the real tokens stay at the 1 it fills and the pads count from 0
    (no packing: documents-leak, which read the count from 0 as a packed document, is left out)."""
    found = check_bug(tmp_path, "pai_megatron_qwen2_vl_get_ltor_rope_index_mask_inverted", "positions-repeated")
    assert tuple(found[0]["cell"]) == (0, 1, 0)  # tokens 0 and 1 of row 0, both real (14 of 20), both at (1, 1, 1)


def test_megatron_bridge_rope_index_given_the_4d_mask(tmp_path):
    """NVIDIA-NeMo/Megatron-Bridge#2582 (fb8404c; written blind, batch blind-dy): Qwen3VLModel.forward hands Megatron's
    (B, 1, S, S) True = masked mask to get_rope_index, whose .any(-1) calls an unpadded row's last token padding: it
    stays at 1, the place of token 1 (ids held by forward(), not handed to the model call)."""
    found = check_bug(tmp_path, "megatron_bridge_qwen3_vl_rope_index_gets_megatron_4d_mask", "positions-repeated")
    assert tuple(found[0]["cell"]) == (0, 17, 1)


def test_left_padded_vlm_rope_index_from_labels_mask(tmp_path):
    """Written another way: a left-padded SFT batch whose rope ids are computed from `labels != -100`, the model given
    the attention_mask (eager softmax): every prompt token stays at 1."""
    found = check_bug(tmp_path, "left_padded_vlm_rope_index_from_labels_mask", "positions-repeated", folder=REPEATED)
    pads, answer = 2, 3  # row 0: 2 left pads, then 9 prompt tokens (left at 1), then 3 answer tokens counted
    expected = first((2, 14, 14), lambda b, q, k: b == 0 and pads <= k < q < 14 - answer)
    assert tuple(found[0]["cell"]) == expected


def test_quiet_on_transformers_qwen2_vl_generating_from_a_left_padded_batch(tmp_path):
    """transformers' Qwen2-VL over two left-padded prompts with an image each: the pads stay at the rope index's fill,
    not real; each real token at ids of its own."""
    pytest.importorskip("transformers")
    status, found, report = traced(tmp_path, "hf_qwen2_vl_left_padded_batch_generate", False, REPEATED)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
