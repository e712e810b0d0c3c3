"""checks/discarded.py (and trace/discarded.py, which records the fill): a masked_fill of the scores whose result the
program threw away, so the softmax attends the keys the fill was to hide."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug, first, traced
from maskcli.trace.discarded import Discarded, wanted

DISCARDED = Path(__file__).parent / "data" / "discarded"


def test_mead_baseline_bahdanau_energies_fill_discarded(tmp_path):
    """mead-baseline#223: `a.masked_fill(keys_mask == 0, -1e9)` as a statement; the Bahdanau energies (a Linear's, no
    q @ kᵀ: the fill itself says they are attention) over padded source states."""
    check_bug(tmp_path, "mead_baseline_bahdanau_attention_masked_fill_discarded", "fill-discarded")


def test_mead_baseline_bahdanau_fill_result_dropped_written_blind(tmp_path):
    """mead-baseline#223 (commit da1e8c2; written blind again, batch blind-ew, caught before any rule was changed for
    it): `a.masked_fill(keys_mask == 0, -1e9)` out of place, its result dropped: batch row 1's query 0 sees padded
    source key 5 in batched decoding."""
    hit = check_bug(tmp_path, "mead_baseline_bahdanau_attention_masked_fill_result_discarded", "fill-discarded")[0]
    assert "batch row 1: query 0 sees key 5" in hit["message"]


def test_luong_bmm_attention_fill_result_dropped_left_padded(tmp_path):
    """mead-baseline#223's slip written as a Luong attention over a teacher-forced target at once (bmm scores
    (B, T, S), a -inf fill as a statement), left-padded sources: the first padded key of batch row 0 (3 pads)."""
    found = check_bug(tmp_path, "luong_bmm_attention_masked_fill_result_dropped", "fill-discarded", DISCARDED)
    assert tuple(found[0]["cell"]) == first((2, 4, 6), lambda b, q, k: b == 0 and k < 3)


def test_parlai_polyencoder_codes_attention_fill_noop(tmp_path):
    """ParlAI#3068: `l1.masked_fill(attn_mask, neginf)` dropped: the codes attend the context's padding."""
    check_bug(tmp_path, "parlai_polyencoder_codes_attention_masked_fill_noop", "fill-discarded")


def test_eduktm_akt_masked_fill_not_inplace(tmp_path):
    """EduKTM#52: `scores.masked_fill(mask == 0, -1e23)` as a statement before AKT's softmax. Its fix was a false alarm
    before trace/weights.py: the distance decay's exp of values made of the masked weights, read as a softmax written
    by hand whose mask was dropped (mask-argument-dropped)."""
    found = check_bug(tmp_path, "eduktm_akt_masked_fill_not_inplace_future_leak", "fill-discarded")
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: k > q)


def test_akt_decay_softmax_reads_the_scores_its_fill_was_made_of(tmp_path):
    """arghosh/AKT 01b7e8d: `scores_ = scores.masked_fill(mask == 0, -1e32)`, then `scores_ = F.softmax(scores)`: the
    fill bound to a name, never read, and the softmax over the unfilled scores (the first cell: a double loop over the
    strictly-past mask's hidden cells on rows it leaves some key, blocks_2.1's call, whose product empties row 0)."""
    found = check_bug(tmp_path, "akt_distance_decay_softmax_ignores_nopeek_mask", "fill-discarded")
    assert tuple(found[0]["cell"]) == first((3, 12, 12), lambda b, q, k: q >= 1 and k >= q)
    assert "bound to a name, is never read" in found[0]["message"]


def test_bound_fill_energies_never_read_padded_batch(tmp_path):
    """Written another way: a right-padded batch's encoder (einsum), `energy_masked = energy.masked_fill(pad, -inf)`
    and the softmax handed `energy`: the first padded key of batch row 1 (4 of 6 real)."""
    found = check_bug(tmp_path, "bound_fill_softmax_reads_raw_energies", "fill-discarded", DISCARDED)
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: b == 1 and k >= 4)


def test_causal_fill_thrown_away_first_cell_and_fixes(tmp_path):
    """Written another way (4-D heads, a causal fill by torch.masked_fill's function form): the first cell is a double
    loop's over the causal mask's later keys; the in-place fill is quiet, and so is a fill whose result is held while
    the raw scores are softmaxed beside it (the program may use them both)."""
    status, found, report = traced(tmp_path, "causal_fill_thrown_away", False, DISCARDED)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "fill-discarded")
    assert hit["severity"] == "wrong"
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: k > q)
    for args in ((), ("--kept",)):
        if args:
            status, found, report = traced(tmp_path, "causal_fill_thrown_away", False, DISCARDED, args)
        else:
            status, found, report = traced(tmp_path, "causal_fill_thrown_away", True, DISCARDED)
        assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_a_dropped_fill_is_remembered_only_while_its_scores_are_unchanged():
    """The record itself: an out-of-place fill of a masking value whose result is gone is found; one whose result is
    held, a fill of 0 (no mask), and scores written since (their version) are not."""
    found = Discarded()
    scores = torch.randn(2, 3, 4)
    mask = torch.tensor([False, False, True, True])
    found.after(torch.Tensor.masked_fill, (scores, mask, -1e9), {}, scores.masked_fill(mask, -1e9))
    hidden, value, _ = found.dropped(scores)
    assert torch.equal(hidden, mask) and value == -1e9
    held = scores.masked_fill(mask, float("-inf"))
    found.after(torch.Tensor.masked_fill, (scores, mask, float("-inf")), {}, held)
    assert found.dropped(scores) is None  # (its result still held: the program may use it)
    assert not wanted((scores, mask, 0.0), {}, scores.masked_fill(mask, 0.0))
    found.after(torch.masked_fill, (scores, mask, -1e9), {}, torch.masked_fill(scores, mask, -1e9))
    scores.add_(1.0)
    assert found.dropped(scores) is None  # (written since: the fill was not of these values)


def test_a_dropped_key_padding_fill_first_cell_and_count(tmp_path):
    """A third way, written here: 4-D scores of one head, a key padding fill from lengths thrown away. The finding's
    first cell and count are a double loop's over the lengths (every query of a row sees its padded keys)."""
    program = tmp_path / "dropped_padding_fill.py"
    program.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "q, k = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 6, 4)\n"
        "pad = torch.arange(6)[None, :] >= torch.tensor([6, 2])[:, None]\n"
        "scores = q @ k.transpose(-1, -2)\n"
        "scores.masked_fill(pad[:, None, None, :], -1e9)\n"
        "print(torch.softmax(scores, -1).shape)\n")
    status, found, report = traced(tmp_path, "dropped_padding_fill", False, tmp_path)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "fill-discarded")
    lengths = [6, 2]
    assert tuple(hit["cell"]) == first((2, 3, 6), lambda b, q, k: k >= lengths[b])
    count = sum(k >= lengths[b] for b in range(2) for q in range(3) for k in range(6))
    assert f"({count} such cells" in hit["message"].replace("\n", " ")


def test_a_fill_under_inference_mode_is_read_without_a_version():
    """Tensors made under torch.inference_mode keep no version counter: the fill is still remembered (and the program
    never sees an error of the trace's: TRL's reference log-probs build their bias so)."""
    found = Discarded()
    with torch.inference_mode():
        scores = torch.randn(2, 3, 4)
        mask = torch.tensor([False, True, False, True])
        found.after(torch.Tensor.masked_fill, (scores, mask, -1e9), {}, scores.masked_fill(mask, -1e9))
        hidden, value, _ = found.dropped(scores)
    assert torch.equal(hidden, mask) and value == -1e9


def test_a_fill_is_a_masking_fill_by_its_value_alone_read_first():
    """hunt 8: the value is read before the tensors (a loop of 10^5 fills of 0 pays two comparisons): at most -1e4, or
    the dtype's lowest (float8_e4m3fn's -448), is a masking fill, a numpy scalar's too (np.int64(-1e9) was missed);
    0, NaN, a bool, a positive value are not."""
    scores, mask = torch.randn(2, 3, 4), torch.tensor([False, True, False, True])
    for value, masking in ((0.0, False), (float("nan"), False), (True, False), (5, False), (-1e4, True),
                           (float("-inf"), True), (torch.tensor(-1e9), True), (-9999.0, False),
                           (np.int64(-10 ** 9), True), (np.float32(-1e9), True), (np.bool_(True), False)):
        assert wanted((scores, mask, value), {}, scores.masked_fill(mask, value)) is masking, value
    low = torch.randn(2, 3, 4).to(torch.float8_e4m3fn)
    assert wanted((low, mask, -448.0), {}, low)
    assert not wanted((scores, mask, -448.0), {}, scores.masked_fill(mask, -448.0))


def test_qwen_sdpa_padding_bias_causal_fill_discarded(tmp_path):
    """QwenLM/Qwen#933: `attention_mask.masked_fill(~causal_mask, min)` as a statement in the SDPA branch: the
    additive padding bias reaches the kernel unfilled, so a padded training batch attends to later tokens."""
    found = check_bug(tmp_path, "qwen_sdpa_padding_mask_masked_fill_discarded", "fill-discarded")
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: k > q)  # the causal fill's first hidden cell


def test_sdpa_key_padding_fill_discarded_first_cell(tmp_path):
    """Written another way: torch.masked_fill's function form filling a left-padded batch's keys into an additive
    causal bias, passed as the attn_mask keyword. The first cell: a double loop over the pads a real query sees
    (row 1 leads with 2 pads; its padding queries see no real key, no statement of theirs)."""
    found = check_bug(tmp_path, "sdpa_padding_fill_thrown_away", "fill-discarded", DISCARDED)
    pads = [0, 2]
    bad = lambda b, q, k: k < pads[b] and k <= q and q >= pads[b]  # noqa: E731
    assert tuple(found[0]["cell"]) == first((2, 5, 5), bad)
    count = sum(bad(b, q, k) for b in range(2) for q in range(5) for k in range(5))
    assert f"({count} such cells" in found[0]["message"].replace("\n", " ")


def test_di_engine_entity_transformer_fill_result_discarded_is_flagged_and_its_fix_is_not(tmp_path):
    # opendilab/DI-engine#333 (dc064896; written blind, blind-iw, round 60; caught before tuning): `score.masked_fill(~mask,
    # -1e9)` without the underscore, its result dropped: every entity attends the padded slots of its sample
    check_bug(tmp_path, "di_engine_entity_transformer_mask_fill_result_discarded", "fill-discarded")
