"""checks/convleft.py (and trace/convpad.py's zero runs): padded tokens whose states carry content, which a causal
convolution of a hybrid model mixes into the real tokens after them, where the model call states them padding."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug
from maskcli.trace.convpad import zero_runs

CONVLEFT = Path(__file__).parent / "data" / "convleft"


def _first_real(lengths: list[int], width: int, row: int, before: int = 0) -> tuple[int, int]:
    """(the first real token, the padded token just before it) of a left-padded row, after `before` cached tokens."""
    pads = width - lengths[row]
    return before + pads, before + pads - 1


def test_transformers_jamba_mamba_mixer_ignores_padding_mask(tmp_path):
    """huggingface/transformers#32914: JambaMambaMixer never got the attention mask; prompts of 5 and 10 tokens, the
    short one left-padded: its first real token (5) reads padded token 4 through the kernel-4 conv."""
    [hit] = check_bug(tmp_path, "transformers_jamba_mamba_mixer_ignores_padding_mask", "padding-convolved-causal")
    t, p = _first_real([5, 10], 10, 0)
    assert tuple(hit["cell"]) == (0, t, p)


def test_transformers_lfm2_shortconv_gets_4d_mask_skips_padding(tmp_path):
    """huggingface/transformers#41790: Lfm2ShortConv was handed the 4-D causal mask, which apply_mask_to_padding_states'
    `shape[1] > 1` gate skips (prompts of 4 and 9 tokens)."""
    [hit] = check_bug(tmp_path, "transformers_lfm2_shortconv_gets_4d_mask_skips_padding", "padding-convolved-causal")
    t, p = _first_real([4, 9], 9, 0)
    assert tuple(hit["cell"]) == (0, t, p)


def test_transformers_recurrent_mask_dropped_on_cache_continuation(tmp_path):
    """huggingface/transformers#47087 (issue #47086): create_recurrent_attention_mask returned None once the cache held a
    state, so the second turn's padding (replies of 7 and 3 tokens, after a 6-token first turn) reached the conv; the
    cell is the call's query (its own tokens) and the key at its place among the 13."""
    [hit] = check_bug(tmp_path, "transformers_recurrent_mask_dropped_on_cache_continuation", "padding-convolved-causal")
    t, p = _first_real([7, 3], 7, 1, before=6)
    assert tuple(hit["cell"]) == (1, t - 6, p)


def test_bamba_mixer_not_given_mask_sdpa_unmasked_rows(tmp_path):
    """Written another way: F.pad on the left then F.conv1d without padding, SDPA's float mask whose padding rows are
    unmasked (so the padded keys are the ones no real query sees), three prompts padded with the EOS id."""
    [hit] = check_bug(tmp_path, "bamba_mixer_not_given_mask_sdpa_unmasked_rows", "padding-convolved-causal",
                      folder=CONVLEFT)
    t, p = _first_real([7, 3, 5], 7, 1)
    assert tuple(hit["cell"]) == (1, t, p)


def test_griffin_conv1d_gets_4d_float_mask_gate_skips(tmp_path):
    """Written another way: a Griffin-style temporal Conv1D handed the (B, 1, T, T) additive mask, which its 2-D gate
    skips; the attention layers are a hand-written softmax over a -1e30 fill."""
    [hit] = check_bug(tmp_path, "griffin_conv1d_gets_4d_float_mask_gate_skips", "padding-convolved-causal",
                      folder=CONVLEFT)
    t, p = _first_real([6, 2, 4], 6, 1)
    assert tuple(hit["cell"]) == (1, t, p)


def test_hybrid_next_turn_mask_sliced_from_start(tmp_path):
    """Written another way: the second turn's conv mask cut from the first columns of the full mask (the first turn's
    ones) instead of its last; nn.Conv1d without padding over [cached conv state, new states]."""
    [hit] = check_bug(tmp_path, "hybrid_next_turn_mask_sliced_from_start", "padding-convolved-causal", folder=CONVLEFT)
    t, p = _first_real([6, 2], 6, 1, before=5)
    assert tuple(hit["cell"]) == (1, t - 5, p)


def test_zero_runs_against_a_loop():
    """Each row's runs of all-zero frames, against a plain loop; a row of more runs than kept is None."""
    zero = torch.rand(4, 30) > 0.5
    zero[0] = False
    zero[1, :7] = True
    zero[1, 7:] = False
    zero[2] = torch.arange(30) % 2 == 0  # 15 runs: more than kept

    def runs(row):
        found, start = [], None
        for t, z in enumerate(row.tolist() + [False]):
            if z and start is None:
                start = t
            elif not z and start is not None:
                found.append((start, t))
                start = None
        return tuple(found)

    got = zero_runs(zero)
    assert got[0] == () and got[1] == ((0, 7),) and got[2] is None
    assert got[3] == (runs(zero[3]) if len(runs(zero[3])) <= 8 else None)


def _hybrid_findings(side: str, zeroed: bool) -> list:
    """padding-convolved-causal's findings on a tiny attention-then-conv model over a batch padded on `side`."""
    from maskcli.checks.context import Run, cross
    from maskcli.checks.convleft import padding_convolved_left
    from maskcli.trace.capture import Trace

    torch.manual_seed(0)
    conv = torch.nn.Conv1d(8, 8, 3, groups=8, padding=2)

    class Hybrid(torch.nn.Module):
        def forward(self, x, attention_mask):
            t = x.shape[1]
            keep = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
            keep = keep | torch.eye(t, dtype=torch.bool)  # (a padded query sees itself: no NaN)
            q = x.view(2, t, 2, 4).transpose(1, 2)
            h = x + torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=keep).transpose(1, 2).reshape(2, t, 8)
            if zeroed:
                h = h * attention_mask[:, :, None]
            return conv(h.transpose(1, 2))[..., :t]

    mask = torch.ones(2, 6, dtype=torch.long)
    if side == "left":
        mask[1, :3] = 0
    else:
        mask[1, 3:] = 0
    with Trace() as t:
        with torch.no_grad():
            Hybrid()(torch.randn(2, 6, 8), mask)
    run = Run([c for c in t.calls if not cross(c)], t.tops)
    return padding_convolved_left(run)


def test_left_padding_with_content_is_caught_and_right_padding_or_zeroed_states_are_quiet():
    """The first real token after three pads (token 3) reads pad 2 through the kernel-3 conv; right padding leaves no
    real token after its pads, and zeroed padded states carry nothing."""
    [(_, hit)] = _hybrid_findings("left", zeroed=False)
    assert hit.cell == (1, 3, 2)
    assert _hybrid_findings("right", zeroed=False) == []
    assert _hybrid_findings("left", zeroed=True) == []


def test_maxtext_qwen3_next_gated_delta_conv_over_the_raw_left_padding(tmp_path):
    """AI-Hypercomputer/maxtext#5295 (written blind, batch blind-pk; missed before tuning): Qwen3-Next's gated delta
    layer ran its causal conv1d (kernel 4) over the raw q/k/v of a left-padded batch and zeroed the pads only after it;
    the padding is stated by `decoder_segment_ids` (0 = padding), and the port pads by hand before a convolution that
    pads itself (19 frames for 13 tokens). Row 1 holds 8 pads: its first real token 8 reads pad 7. The fix zeroes q/k/v
    where the segment id is 0 first."""
    [hit] = check_bug(tmp_path, "maxtext_qwen3_next_gdn_conv1d_left_padding_bleed", "padding-convolved-causal",
                      Path(__file__).parent / "data" / "blind")
    real, pad = _first_real([13, 5, 8], 13, 1)  # (rows of 13, 5 and 8 real tokens: 0, 8 and 5 pads)
    assert tuple(hit["cell"]) == (1, real, pad) == (1, 8, 7)
    assert "decoder_segment_ids (0 = padding)" in hit["message"]


def test_segment_ids_short_conv_padded_twice_states_not_zeroed(tmp_path):
    """Written another way: a short-conv mixer beside a causal attention masked by segment equality, T5X-style
    `decoder_segment_ids`, its input padded by hand before a causal convolution that pads itself; row 1 left-padded
    by 3, so its first real token 3 reads pad 2 (kernel 3)."""
    [hit] = check_bug(tmp_path, "segment_ids_short_conv_padded_twice_states_not_zeroed", "padding-convolved-causal",
                      CONVLEFT)
    real, pad = _first_real([7, 4], 7, 1)
    assert tuple(hit["cell"]) == (1, real, pad)
