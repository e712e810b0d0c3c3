"""checks/biaswindows.py (trace/posbias.py's addend shapes, trace/queried.py's heads_folded): a per-head position bias
added to (B * H, windows, Lq, Lk) scores, its head axis on the windows."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

from checkbugs import BUGS, check_bug, first, traced

WINDOWS = Path(__file__).parent / "data" / "biaswindows"


def _reference(planes: torch.Tensor, q_len: int, k_len: int, length: int, kept, own_sees) -> tuple:
    """The first (0, q, k), by a double loop over absolute positions of batch row 0, head 0, where the bias the sum
    applies (plane w = q // q_len at the query's row, less its own key's) differs from head 0's own plane at the same
    cell, at a distance head 0's window 0 also attends (`own_sees(d)`: where its bias is shown)."""
    before = k_len - q_len

    def bad(_b, q, k):
        if q < q_len or not kept(q, k) or not own_sees(k - q):
            return False
        w, i = divmod(q, q_len)
        j = i + before + (k - q)
        applied = planes[w, i, j] - planes[w, i, i + before]
        own = planes[0, i, j] - planes[0, i, i + before]
        return abs(float(applied - own)) > 1e-4 * float(planes.abs().max())
    return first((1, length, length), bad)


def test_local_attention_dynamic_position_bias_broadcast_over_windows(tmp_path):
    """lucidrains/local-attention ab766fd (written blind, batch blind-fv): LocalAttention added LocalTransformer's
    DynamicPositionBias (4 heads, 16 x 32) straight onto (2 * 4, 4 windows, 16, 32) scores; the fix repeats it to
    '(b h) 1 i j'. The cell against the bias the model's own DynamicPositionBias makes (seed 0, before the step)."""
    hits = check_bug(tmp_path, "local_attention_dynamic_pos_bias_broadcast_over_windows", "position-bias-on-windows")
    assert len(hits) == 1 and hits[0]["severity"] == "wrong"
    program = runpy.run_path(str(BUGS / "local_attention_dynamic_pos_bias_broadcast_over_windows.py"), run_name="x")
    torch.manual_seed(0)
    model = program["LocalTransformer"](num_tokens=256, dim=64, depth=2, max_seq_len=64, causal=True,
                                        local_attn_window_size=16, dim_head=16, heads=4, use_dynamic_pos_bias=True)
    with torch.no_grad():
        planes = model.dynamic_pos_bias(16, 32).double()
    # exact window of 16 behind each query; window 0's look-back columns (position -1) are not masked there
    cell = _reference(planes, 16, 32, 64, lambda q, k: k <= q and q - k <= 16, lambda d: -16 <= d <= 0)
    assert tuple(hits[0]["cell"]) == cell, hits[0]
    assert f"Query {cell[1]} (window 1) of batch row 0, head 0, gets head 1's bias toward key {cell[2]}" in \
        " ".join(hits[0]["message"].split())


def test_t5_buckets_added_in_place_to_chunked_scores_right_padded(tmp_path):
    """Written another way: T5 buckets (nn.Embedding(8, num_heads), (H, 8, 16)) added in place by `scores +=` to
    matmul scores (2 * 4, 4 chunks, 8, 16) over a right-padded batch, an additive -inf mask; --fixed lays the bias
    (B * H, 1, 8, 16). The cell against the layer's own buckets, at a distance its chunk 0 attends (-7 .. 0)."""
    name = "chunked_local_t5_buckets_added_per_window_right_padded"
    hits = check_bug(tmp_path, name, "position-bias-on-windows", WINDOWS)
    assert len(hits) == 1 and hits[0]["severity"] == "wrong"
    program = runpy.run_path(str(WINDOWS / f"{name}.py"), run_name="x")
    torch.manual_seed(0)
    layer = program["ChunkedLocalSelfAttention"]()
    with torch.no_grad():
        planes = layer.position_bias().double()
    lengths = (32, 27)
    cell = _reference(planes, 8, 16, 32, lambda q, k: 0 <= k <= q and q - k < 16 and k < lengths[0],
                      lambda d: -7 <= d <= 0)
    assert tuple(hits[0]["cell"]) == cell, hits[0]


def test_quiet_on_a_per_head_alibi_laid_per_batch_row_and_head(tmp_path):
    """Correct: ALiBi slopes made per (batch row, head), (B * H, 1, 6, 12), on (2 * 4, 4 chunks, 6, 12) scores over a
    left-padded batch, masked_fill(finfo.min): no finding at all of this rule, no wrong or suspicious one."""
    status, found, report = traced(tmp_path, "quiet_chunked_local_alibi_per_head_rows_left_padded", False, WINDOWS)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [] and status == 0, report
