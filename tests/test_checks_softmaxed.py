"""checks/softmaxed.py (with maskcli/trace/after.py, which follows a softmax's weights): a mask written into the
weights after the softmax (-inf, or a fill at most -1e4), on a reproduction of a published bug and on programs written
otherwise, and quiet where the mask is filled into the scores before the softmax or rows are zeroed after it."""

from __future__ import annotations

import math

import numpy as np

import torch
import torch.nn.functional as F

import maskcli
from pathlib import Path

from checkbugs import check_bug
from maskcli.checks.registry import severity
from maskcli.testing import keep_array

FIXQ2 = Path(__file__).parent / "data" / "fixq2"


def test_nisqa_alignment_mask_after_softmax_is_flagged_and_its_fix_is_not(tmp_path):
    # gabrielmittag/NISQA#17: -inf written into softmaxed weights over padded reference windows
    check_bug(tmp_path, "nisqa_alignment_masks_after_softmax", "masked-after-softmax")


def traced(program) -> list:
    with maskcli.trace() as t, torch.no_grad():
        program()
    return [(f.code, severity(f), f.message) for group in t.groups() for f in group.findings]


def _heads(lengths, length=5, heads=2, left=True):
    torch.manual_seed(0)
    q = torch.randn(len(lengths), heads, length, 4)
    k = torch.randn(len(lengths), heads, length, 4)
    v = torch.randn(len(lengths), heads, length, 4)
    keep = torch.zeros(len(lengths), length, dtype=torch.bool)
    for b, n in enumerate(lengths):  # (a loop over rows: the reference padding, left or right)
        if left:
            keep[b, length - n:] = True
        else:
            keep[b, :n] = True
    return q, k, v, keep


def test_a_multi_head_left_padded_fill_after_softmax_is_wrong():
    """Written otherwise: 4-D heads, left padding, out-of-place masked_fill with a finite -1e9 after the softmax."""
    q, k, v, keep = _heads([5, 3])

    def program():
        weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
        weights = weights.masked_fill(~keep[:, None, None, :], -1e9)
        return weights @ v

    found = [f for f in traced(program) if f[0] == "masked-after-softmax"]
    assert len(found) == 1 and found[0][1] == "wrong", found
    # the cells filled, by a plain loop: 2 heads x 5 queries x the 2 padded keys of batch row 1
    cells = sum(1 for b in range(2) for h in range(2) for i in range(5) for j in range(5) if not keep[b, j])
    assert f"-1e+09 into {cells} cells" in found[0][2] and "batch rows [1]" in found[0][2], found


def test_an_in_place_fill_of_minus_inf_after_softmax_is_wrong():
    q, k, v, keep = _heads([2, 4], left=False)

    def program():
        weights = F.softmax(torch.matmul(q, k.transpose(2, 3)), dim=-1)
        weights.masked_fill_(~keep[:, None, None, :], float("-inf"))
        return torch.matmul(weights, v)

    found = [f for f in traced(program) if f[0] == "masked-after-softmax"]
    assert len(found) == 1 and found[0][1] == "wrong" and "batch rows [0, 1]" in found[0][2], found


def test_the_mask_filled_before_the_softmax_is_quiet_and_matches_sdpa():
    q, k, v, keep = _heads([5, 3])
    out = {}

    def program():
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores[~keep[:, None, None, :].expand_as(scores)] = float("-inf")
        out["eager"] = torch.softmax(scores, dim=-1) @ v

    found = traced(program)
    assert [f for f in found if f[0] == "masked-after-softmax" or f[1] == "wrong"] == [], found
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    assert torch.allclose(out["eager"], reference, atol=1e-6)


def test_rows_zeroed_after_the_softmax_are_quiet():
    """WeNet / ESPnet: scores filled before, then rows with no key zeroed after (a fill of 0, not a mask)."""
    q, k, v, keep = _heads([5, 3])
    keep[1] = False  # a row with no key at all

    def program():
        pad = ~keep[:, None, None, :]
        scores = (q @ k.transpose(-1, -2)).masked_fill(pad, float("-inf"))
        weights = torch.softmax(scores, dim=-1).masked_fill(pad, 0.0)
        return weights @ v

    assert [f for f in traced(program) if f[0] == "masked-after-softmax"] == []


def test_timm_eva_mask_applied_after_softmax(tmp_path):
    """huggingface/pytorch-image-models#2236 (written blind, caught before any rule was changed for it): EvaAttention
    fills the padding with -inf after the softmax; the fix fills the scores before it and is quiet."""
    found = check_bug(tmp_path, "timm_eva_attention_mask_applied_after_softmax", "masked-after-softmax")
    assert "after the softmax" in found[0]["message"]


def test_flamingo_rows_zeroed_out_of_place_are_lost(tmp_path):
    """lucidrains/flamingo-pytorch 10913ab (written blind): `attn.masked_fill(text_without_media_mask, 0.)` not
    assigned, so text before the first image attends every image uniformly; its fix assigns it. The rows named are
    those whose cumulative media count is 0, by a loop over the program's own token ids."""
    [hit] = check_bug(tmp_path, "flamingo_text_before_first_media_attention_not_zeroed", "zeroing-lost")
    text = [[9, 9, 9, 5, 11, 12, 13, 5, 14, 15], [9, 5, 11, 12, 13, 14, 5, 15, 16, 17]]
    before = sorted({q for row in text for q in range(len(row)) if 5 not in row[:q + 1]})
    assert f"query rows {before[0]}-{before[-1]}" in hit["message"], hit


def test_rows_zeroed_into_a_copy_the_product_never_reads_are_lost():
    """Written another way: torch.masked_fill (the function) over the emptied rows of a left-padded query-and-key mask,
    filled with -inf, bound to a name torch.matmul never reads; the product is NaN there exactly as softmax's own
    weights are. Reading the zeroed copy instead is quiet (and its output is finite)."""
    q, k, v, keep = _heads([3, 5])
    outputs = {}

    def program(read_copy):
        def run():
            pair = keep[:, None, :, None] & keep[:, None, None, :]
            attn = torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~pair, float("-inf")), dim=-1)
            zeroed = torch.masked_fill(attn, ~keep[:, None, :, None], 0.0)
            outputs[read_copy] = torch.matmul(zeroed if read_copy else attn, v)
        return run

    found = traced(program(False))
    [hit] = [f for f in found if f[0] == "zeroing-lost"]
    empty = [t for t in range(5) if not keep[0, t]]  # (batch row 0's padding queries, by a loop)
    assert hit[1] == "wrong" and f"query rows {empty[0]}-{empty[-1]}" in hit[2], hit
    assert torch.isnan(outputs[False][0, :, empty]).all()
    assert [f for f in traced(program(True)) if f[0] == "zeroing-lost"] == []
    assert not torch.isnan(outputs[True]).any()


def test_a_zeroing_copy_from_a_file_program_two_layers(tmp_path):
    """tests/data/fixq2's left-padded two-layer encoder: the typo'd copy is caught (zeroing-lost), its fix is quiet."""
    check_bug(tmp_path, "streaming_encoder_zeroed_rows_bound_to_another_name", "zeroing-lost", FIXQ2)


def test_a_causal_head_mask_without_its_diagonal_empties_the_first_query(tmp_path):
    """NVIDIA-Merlin/Transformers4Rec 3d94628 (written blind, batch blind-an): the causal head_mask multiplied into GPT-2's
    probabilities is `torch.tril(ones, diagonal=-1)`: no interaction keeps its own weight and the first reads nothing,
    though GPT-2's own `bias` mask before the softmax keeps each query's own key. The fix's tril is quiet. Against the
    softmax and the product themselves: the first row's weights are all 0 after the product, the others' are not."""
    [hit] = check_bug(tmp_path, "transformers4rec_gpt2_head_mask_tril_excludes_diagonal", "emptied-after-softmax")
    assert tuple(hit["cell"]) == (0, 0, 0)
    weights = torch.softmax(torch.randn(4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), -1e4), -1)
    product = weights * torch.tril(torch.ones(4, 4), diagonal=-1)
    assert product[0].abs().sum() == 0 and (product[1:].sum(-1) > 0).all()
    assert (weights * torch.tril(torch.ones(4, 4))).equal(weights)  # (the fix's product changes nothing)


def test_a_future_mask_with_its_diagonal_multiplied_into_left_padded_weights(tmp_path):
    """Written another way (tests/data/headmask): einsum attention over a left-padded batch, padding and later keys
    filled before torch.softmax, then the weights times `1 - triu(ones, 0)`: the first real item of each session reads
    nothing (its padded rows, which see no real key, are not the finding's). The fix's triu(ones, 1) is quiet."""
    [hit] = check_bug(tmp_path, "session_future_mask_multiplied_drops_diagonal", "emptied-after-softmax",
                      Path(__file__).parent / "data" / "headmask")
    assert tuple(hit["cell"]) == (0, 2, 2)  # batch row 0's first real item, at position 2 after its 2 pads


def test_a_query_mask_from_a_sum_before_abs_calls_a_real_item_padding(tmp_path):
    """JiachengLi1995/TiSASRec#1 (commit 1bd63d0, written blind, batch blind-ei): the query mask multiplied into the
    weights after the softmax is `sign(abs(sum(q)))`, so a real item whose layer-normalised query sums to 0 reads as
    padding, while the key mask (from the unnormalised sequence) keeps its key. The fix's sign(sum(abs(q))) is quiet.
    Against the statistic itself: a zero-sum real vector is 0 under the bug's test, nonzero under the fix's."""
    [hit] = check_bug(tmp_path, "tisasrec_multihead_attention_query_key_mask_sum_before_abs", "emptied-after-softmax")
    assert "query mask" in hit["message"]
    x = torch.tensor([[1.0, -1.0, 2.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.sign(torch.abs(x.sum(-1))).tolist() == [0.0, 0.0]
    assert torch.sign(x.abs().sum(-1)).tolist() == [1.0, 0.0]


def test_a_query_mask_from_an_embedding_sum_disagrees_with_the_ids_key_mask(tmp_path):
    """Written another way (tests/data/headmask): a right-padded bidirectional einsum encoder whose key mask is the ids'
    (0 = padding) and whose query mask after the softmax is `emb.sum(-1) != 0`: item 7, whose embedding sums to 0,
    reads nothing (first at batch row 0, position 3). The fix's `emb.abs().sum(-1) != 0` is quiet."""
    [hit] = check_bug(tmp_path, "bert4rec_query_mask_from_centered_embedding_sum", "emptied-after-softmax",
                      Path(__file__).parent / "data" / "headmask")
    assert tuple(hit["cell"]) == (0, 3, 3) and "query mask" in hit["message"]


def test_an_exp_filled_with_zero_before_its_sum_is_the_calls_mask():
    """A softmax written by hand as exp, masked_fill(pad, 0), / sum (Practical_NLP_in_PyTorch's fix): the call's mask is
    the padding's, as a double loop over the keys says; the exp alone reads as full."""
    lengths, length = (5, 3), 5
    torch.manual_seed(0)
    q, k = torch.randn(2, length, 4), torch.randn(2, length, 4)
    pad = torch.tensor([[i >= n for i in range(length)] for n in lengths])

    def program(fill: bool):
        weights = torch.exp(torch.bmm(q, k.transpose(1, 2)) / 2)
        if fill:
            weights = weights.masked_fill(pad[:, None, :].expand(2, length, length), 0)
        return weights / weights.sum(dim=-1, keepdim=True)

    for fill in (True, False):
        with maskcli.trace() as t, torch.no_grad():
            program(fill)
        keep = keep_array(t.calls[0])
        expected = [[[fill is False or k_ < n for k_ in range(length)] for _ in range(length)] for n in lengths]
        assert np.broadcast_to(keep, (2, 1, length, length))[:, 0].tolist() == expected
