"""checks/loopcausal.py: a generation loop that re-runs its whole sequence one token longer each call, through a
decoder whose self-attention lets a token see a later appended one: candle#1146's BLIP captioning decoder (written
blind) and a TinyGPT of nn.TransformerEncoderLayer sampled greedily; both fixes quiet; the loops read against a
reference over hand-made calls."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import check_bug, traced
from maskcli.checks.loopcausal import _loops

LOOPCAUSAL = Path(__file__).parent / "data" / "loopcausal"


def test_candle_blip_captioning_decoder_without_a_causal_mask_is_flagged(tmp_path):
    # huggingface/candle#1146 (3115fe42e; written blind, batch blind-gp): the BLIP text decoder's self-attention had no
    # mask while the captioning example re-ran the caption each step from [BOS]; the fix adds -inf above the diagonal
    found = check_bug(tmp_path, "candle_blip_text_decoder_captioning_no_causal_mask", "loop-sees-later")
    message = " ".join(found[0]["message"].split())
    assert message.startswith("batch row 0: query 0 sees the later key 1, a token the generation loop appended: "
                              "TextLMHeadModel is called on its whole sequence again each step, one token longer (ids "
                              "of 1 token, then 2, 3, ...)"), message


def test_tiny_gpt_sampled_by_rerunning_without_a_causal_mask_is_flagged(tmp_path):
    # written another way: prompts of 3 tokens, 5 greedy steps; every prompt token sees the tokens appended after it
    [hit, *_] = check_bug(tmp_path, "tiny_gpt_encoder_layers_greedy_rerun_no_causal_mask", "loop-sees-later", LOOPCAUSAL)
    message = " ".join(hit["message"].split())
    assert "query 0 sees the later key 3" in message and "(ids of 3 tokens, then 4, 5, ...)" in message


def _top(where, ids):
    return SimpleNamespace(where=where, arguments={"input_ids": np.array(ids)}, first=0, end=0, config=None)


def test_loops_are_runs_of_three_calls_each_one_token_longer():
    grow = [_top("Dec", [[1] + [2] * n]) for n in range(4)]  # lengths 1, 2, 3, 4
    assert [(start, len(tops)) for start, tops in _loops(SimpleNamespace(tops=grow))] == [(1, 3)]
    two = [_top("Dec", [[1]]), _top("Dec", [[1, 2]])]  # (two calls: no loop)
    assert _loops(SimpleNamespace(tops=two)) == []
    changed = [_top("Dec", [[1]]), _top("Dec", [[1, 2]]), _top("Dec", [[3, 2, 4]])]  # (an earlier token changed)
    assert _loops(SimpleNamespace(tops=changed)) == []
    blocks = [_top("Dec", [[1] * n]) for n in (2, 4, 6)]  # (two tokens a call: a diffusion LM's blocks)
    assert _loops(SimpleNamespace(tops=blocks)) == []
    other = [_top("Dec", [[1]]), _top("Enc", [[1, 2]]), _top("Dec", [[1, 2, 3]])]  # (another module between)
    assert _loops(SimpleNamespace(tops=other)) == []


def test_generate_without_a_cache_a_prefix_lm_and_a_masked_lm_filling_are_quiet(tmp_path):
    # transformers' generate(use_cache=False) over a left-padded batch, a prefix LM's re-run loop (its prompt both ways
    # among itself: the same loop with every key seen is flagged), a masked LM filling the [MASK] it appends each step
    status, found, report = traced(tmp_path, "quiet_generate_loops_without_a_cache", False, LOOPCAUSAL)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_image_tokens_before_the_caption_and_a_vision_tower_run_again_each_step(tmp_path):
    """GIT's greedy loop re-run without a cache (quiet-r82b, written blind: loop-sees-later said its vision tower's
    patches and its image prefix were appended tokens). The decoder's keys are the image's tokens and then the ids, so
    an appended token's key sits that many columns on; a vision tower whose keys do not grow with the ids attends none.
    Written another way, a captioner of the program's own with 4 image tokens whose caption block is all ones: flagged
    where the first caption token (column 4) sees the first appended one (column 5); its fix is quiet."""
    status, found, report = traced(tmp_path, "quiet_git_image_prefix_bidirectional_caption_causal_right_padded", False,
                                   Path(__file__).parent / "data" / "quiet_blind")
    assert status == 0 and "loop-sees-later" not in [f["code"] for f in found], report
    [hit] = check_bug(tmp_path, "image_prefix_captioner_rerun_loop_text_sees_later", "loop-sees-later", LOOPCAUSAL)
    prefix = 4  # PATCHES
    assert tuple(hit["cell"]) == (0, prefix, prefix + 1)
