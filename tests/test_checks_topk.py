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


def _smallest_dropped(turned: bool, causal: bool) -> list:
    """topk-mask-not-topk's findings on a softmax whose keep-mask drops each row's topk(2, largest=False) (a KNN
    graph filter's), turned round or not, a causal mask laid after the ranking or not."""
    import torch

    from maskcli.checks.context import Run
    from maskcli.checks.topk import ranked
    from maskcli.trace.capture import Trace

    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with Trace() as t:
        sim = q @ k.transpose(-1, -2)
        keep = torch.ones_like(sim, dtype=torch.bool).scatter(-1, sim.topk(2, dim=-1, largest=False).indices, False)
        keep = ~keep if turned else keep
        keep = keep & torch.ones(5, 5, dtype=torch.bool).tril() if causal else keep
        sim.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return [finding for _, finding in ranked(Run(t.calls, t.tops))]


def test_a_topk_of_the_smallest_states_the_keys_dropped():
    """TimeFilter's KNN: `topk(adj, k, largest=False)` scattered to 0 keeps the rest; a mask laid after it drops more
    keys (no slot of a top-k lost: quiet), and a mask that keeps only the keys it dropped is turned round. The first
    row turned round, by a loop over the scores: its kept keys are the 2 lowest."""
    import torch

    assert _smallest_dropped(False, False) == [] and _smallest_dropped(False, True) == []
    [found] = _smallest_dropped(True, False)
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    row = [float((q[0, 0, 0] * k[0, 0, j]).sum()) for j in range(5)]
    lowest = sorted(range(5), key=lambda j: row[j])[:2]  # (the loop's reading: query 0 keeps its 2 lowest keys)
    assert f"query 0 keeps {len(lowest)} of 5 keys" in found.message
    assert "batch row 0, head 0: query 0 keeps 2 of 5 keys, none of the 3 its scores' topk(2, largest=False) left" \
        in found.message
    assert [f.code for f in _smallest_dropped(True, True)] == ["topk-mask-not-topk"]
