"""checks/topk.py: a sparse top-k attention whose softmax keeps more or fewer keys than its topk ranked, caught in the
published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/topk), quiet on both
fixes, and quiet where a topk is taken for another use; the flagged query row against the program's own softmax
weights counted by a plain loop."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from checkbugs import check_bug, traced

TOPK = Path(__file__).parent / "data" / "topk"


def test_a_top_k_mask_turned_round_and_taken_before_the_causal_mask_is_found(tmp_path):
    # lucidrains/x-transformers d1f5d6b: Attend's sparse_topk mask `sim < top_values[..., -1:]` used as the keep-mask
    # (the 4 best keys dropped), and ranked before the causal masked_fill; its --fixed twin, a top-k that differs by
    # head and row on purpose, is no padding laid on another row's heads
    found = check_bug(tmp_path, "x_transformers_attend_sparse_topk_mask_inverted_and_precausal", "topk-mask-not-topk")
    assert "the wrong way round" in found[0]["message"] and "topk(4) picked" in found[0]["message"]


def test_a_top_k_taken_before_the_key_padding_mask_is_found(tmp_path):
    # written another way: Explicit Sparse Transformer's torch.topk / torch.lt / masked_fill(-1e18) over a right-padded
    # batch (lengths 8 and 5, k = 3), the padding filled after the ranking
    found = check_bug(tmp_path, "explicit_sparse_topk_before_padding_mask", "topk-mask-not-topk", folder=TOPK)
    spec = importlib.util.spec_from_file_location("sparse_topk", TOPK / "explicit_sparse_topk_before_padding_mask.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    p = program.weights()
    rows, heads, length, _ = p.shape
    short = [(b, h, q) for b in range(rows) for h in range(heads) for q in range(length)
             if sum(1 for k in range(length) if p[b, h, q, k] > 0) < 3]
    assert short and all(b == 1 for b, _, _ in short)  # (only the padded row's queries lose slots)
    b, h, q = short[0]
    assert f"batch row {b}, head {h}: query {q} keeps" in found[0]["message"]
    assert f"({len(short)} such query rows)" in found[0]["message"]


def test_a_topk_taken_to_log_the_top_keys_is_no_mask(tmp_path):
    # a causal layer ranks its raw scores with topk(3) for logging and softmaxes over every past key: quiet
    status, found, report = traced(tmp_path, "causal_attention_logs_top_keys", False, TOPK)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == []
