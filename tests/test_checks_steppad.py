"""checks/steppad.py: a trajectory batch's step mask, confirmed by the model call's zero-padded input, that never reaches
the attention over k tokens a step: caught in the published bug's reproduction (tests/data/bugs) and in a program
written another way (tests/data/steppad), quiet on the fixes and on right padding under a causal mask; the flagged
cell against a double loop over the steps each token stands for."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

STEPPAD = Path(__file__).parent / "data" / "steppad"


def test_decision_transformer_front_padded_steps_attended_is_found(tmp_path):
    # takuseno/d3rlpy 9251cdeb: trajectories of 6, 4, 2 steps padded in front to 6, (return, state, action) interleaved,
    # only the causal tril applied: a real step's tokens see the padded steps' tokens
    found = check_bug(tmp_path, "d3rlpy_decision_transformer_padded_timesteps_not_masked", "padded-steps-attended")
    lengths, steps = (6, 4, 2), 6

    def real(b, token):
        return token // 3 >= steps - lengths[b]

    assert tuple(found[0]["cell"]) == first((3, 18, 18), lambda b, q, k: k <= q and real(b, q) and not real(b, k))
    assert 'batch["masks"]' in found[0]["message"] and "3 tokens a step" in found[0]["message"]


def test_online_dt_state_action_tokens_left_padded_mask_dropped_is_found(tmp_path):
    # written another way: Online-DT's left-padded loader, (state, action) tokens, SDPA is_causal, a dataclass config,
    # the mask held by the training step and never handed to the model
    name = "online_dt_left_padded_state_action_tokens_mask_dropped"
    found = check_bug(tmp_path, name, "padded-steps-attended", folder=STEPPAD)
    lengths, steps = (5, 3, 2, 5), 5  # (the last 5 steps of trajectories of 7, 3, 2, 5)

    def real(b, token):
        return token // 2 >= steps - lengths[b]

    assert tuple(found[0]["cell"]) == first((4, 10, 10), lambda b, q, k: k <= q and real(b, q) and not real(b, k))
    assert "attention_mask in train_step()" in found[0]["message"] and "`states`" in found[0]["message"]


def test_right_padded_steps_under_a_causal_mask_are_quiet(tmp_path):
    # min-decision-transformer: zeros after the real steps, traj_mask for the loss only; causal hides them anyway
    status, found, report = traced(tmp_path, "min_dt_right_padded_causal_traj_mask_loss_only", False, STEPPAD)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_mlx_vlm_lfm2_vision_tower_run_without_its_pixel_attention_mask(tmp_path):
    """Blaizzy/mlx-vlm#2266 (written blind, batch blind-mt; caught before any rule changed for it): LFM2-VL's vision
    tower packed images of different sizes padded to one length and ran its encoder with mask=None, cutting each
    image's features out only afterwards. The fix hands the pixel_attention_mask to every encoder layer."""
    hit = check_bug(tmp_path, "mlx_vlm_lfm2_vl_vision_tower_ignores_pixel_attention_mask", "padded-steps-attended")[0]
    assert "pixel_attention_mask in get_input_embeddings()" in " ".join(hit["message"].split())
