"""checks/runalone.py: a stretch of a batch row that the program also runs alone through the same model, hidden as
padding or attended otherwise in the batch, on the published bugs' reproductions (tests/data/bugs) and programs
written another way (tests/data/runalone), each quiet fixed; the stretch's reading against a loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, traced
from maskcli.checks.runalone import _at, _bounded, _cut_short

RUNALONE = Path(__file__).parent / "data" / "runalone"
BLIND = Path(__file__).parent / "data" / "blind"


def test_an_eos_equal_to_pad_masked_out_of_each_response_is_found(tmp_path):
    """alibaba/ROLL#304 (written blind, batch blind-cd): Qwen3's eos == pad, the response mask is `ids != pad`, so each
    response's eos is padding in the actor's batch; the program's reference runs each sequence alone with its eos."""
    found = check_bug(tmp_path, "roll_pad_eq_eos_masks_response_eos", "unlike-run-alone")
    assert [f["cell"] for f in found][:2] == [[0, 8, 8], [1, 7, 7]]
    assert "the program runs tokens 2-8 of batch row 0 alone (7 tokens" in found[0]["message"]
    assert "calls 1 of them padding (token 8, id 3)" in found[0]["message"]


def test_documents_packed_between_pad_ids_under_a_plain_causal_mask_are_found(tmp_path):
    """0-5788719150923125/praxis#38 (written blind, batch blind-cd): documents packed between pad ids, a plain triu
    causal mask; the program runs document B alone. Fixed: same block AND causal (create_block_ids)."""
    [hit, *_] = check_bug(tmp_path, "praxis_packed_sequences_plain_causal_mask", "unlike-run-alone")
    assert hit["message"].startswith("the program runs tokens 6-9 of batch row 0 alone (4 tokens")
    assert "query 6 of that stretch sees key 0 outside it" in hit["message"]
    assert hit["cell"] == [0, 6, 0]


def test_documents_packed_between_eos_ids_in_a_padded_batch_are_found(tmp_path):
    """Written another way: a nanoGPT-style decoder (eos id in its config dataclass), two packed rows, one
    right-padded, SDPA handed causal AND key padding only; document B run alone. Fixed: AND same document."""
    [hit, *_] = check_bug(tmp_path, "packed_eos_separated_batch_sdpa_bool_mask", "unlike-run-alone", RUNALONE)
    assert hit["cell"] == [0, 4, 0]


def test_an_sft_collator_masking_the_eos_it_pads_with_is_found(tmp_path):
    """Written another way: pad == eos, `input_ids != pad_id` masks each example's eos; nn.MultiheadAttention with a
    causal attn_mask and a key_padding_mask; each example run alone with its eos. Fixed: the mask from the lengths."""
    found = check_bug(tmp_path, "sft_collator_eos_pad_masks_eos_mha", "unlike-run-alone", RUNALONE)
    assert [f["cell"] for f in found][:2] == [[0, 5, 5], [1, 3, 3]]


def _dropped(found: list, samples: list, prefix: int, pad: int) -> None:
    """Each finding's row attends as many keys as its sample run alone (its ids and `prefix` image embeddings), less its
    tokens at the pad id, counted here from the samples."""
    assert len(found) == len(samples)
    for hit, sample in zip(found, samples):
        alone = prefix + len(sample)
        assert f"attends {alone} keys there" in hit["message"], hit["message"]
        assert f"the row attends {alone - sample.count(pad)} keys at the same site" in hit["message"], hit["message"]


def test_a_multimodal_collator_whose_pad_is_the_eot_drops_each_turns_end(tmp_path):
    """LLaVA-VL/LLaVA-NeXT db8bc66 (written blind, batch blind-cy): llama3's pad == eos (<|eot_id|>), the collator's
    `input_ids.ne(pad_token_id)` marks every turn's eot padding and prepare_inputs_labels_for_multimodal drops those
    tokens before the image features go in; the program runs each conversation alone. Fixed: pad_token_id = 0."""
    found = check_bug(tmp_path, "llava_next_collator_pad_equals_eos_masks_eot", "unlike-run-alone")
    samples = [[1, 2, 3, -200] + [0] * n_user + [9, 1, 4, 3] + [0] * n_ans + [9] for n_user, n_ans in [(5, 6), (2, 3), (7, 2)]]
    _dropped(found, [[t for t in s if t != -200] for s in samples], 4, 9)  # (the placeholder becomes 4 features)


def test_a_captioner_that_keeps_the_text_its_mask_keeps_left_padded_is_found(tmp_path):
    """Written another way: a model of its own puts image embeddings before the text its mask keeps, left padding,
    the config dataclass's pad id == <|im_end|>, SDPA; each sample run alone. Fixed: the mask from the lengths."""
    found = check_bug(tmp_path, "vlm_prefix_collator_pad_eos_drops_turn_ends_left_padded", "unlike-run-alone", RUNALONE)
    samples = [[5, 9, 11, 2, 6, 13, 17, 19, 2], [5, 21, 2, 6, 23, 2], [5, 30, 31, 32, 2, 6, 40, 2]]
    _dropped(found, samples, 3, 2)


def test_a_padded_row_whose_every_query_attends_its_pad_tokens_beside_added_features_is_found(tmp_path):
    """oarriaga/paz#422 (written blind, batch blind-io): Florence-2's encoder over 34 image tokens and right-padded
    instruction tokens, handed no mask (`build` passed None); the program encodes the short instruction alone. The
    model lengthens its ids, so the call's keys are no positions of them: each query of the row attends its 4 pad
    tokens more than any query alone (37 keys, against 34 + 3 by the program's inputs). Written another way: audio
    frames put after the text, the pad id in a config dataclass, SDPA. Both fixes hand the mask from the ids."""
    [hit] = check_bug(tmp_path, "paz_florence2_encoder_padded_instruction_tokens_attended", "unlike-run-alone", BLIND)
    assert "attends 37 keys there" in hit["message"] and "other 4 tokens are the pad id 1 (token 3)" in hit["message"]
    assert "each query of the row attends 41 keys" in hit["message"]  # 34 + 7: every key, the 4 pads among them
    [hit] = check_bug(tmp_path, "audio_text_encoder_frames_after_padded_text_unmasked", "unlike-run-alone", RUNALONE)
    assert "attends 9 keys there" in hit["message"] and "each query of the row attends 11 keys" in hit["message"]  # 4 + 5, 6 + 5


def test_a_right_padded_causal_row_beside_added_features_is_quiet(tmp_path):
    """The same lengthened model run causal with no mask over right padding: the row's real queries never see its
    pads (each sees only earlier keys), so no query-agnostic count may call it wrong: its first query sees one key."""
    program = (RUNALONE / "audio_text_encoder_frames_after_padded_text_unmasked.py").read_text()
    causal = program.replace("x = torch.cat([self.embed(input_ids), self.audio(audio_features)], dim=1)",
                             "x = torch.cat([self.audio(audio_features), self.embed(input_ids)], dim=1)")
    causal = causal.replace("attn_mask=mask)", "attn_mask=mask, is_causal=mask is None)")
    assert causal.count("is_causal") == 1 and "self.audio(audio_features), self.embed" in causal
    (tmp_path / "causal_frames.py").write_text(causal)
    status, found, report = traced(tmp_path, "causal_frames", False, tmp_path)
    assert status == 0 and [f for f in found if f["code"] == "unlike-run-alone"] == [], report


def test_a_stretch_is_read_once_and_bounded_against_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        row = rng.integers(0, 4, size=9)
        n = int(rng.integers(1, 5))
        stretch = rng.integers(0, 4, size=n)
        places = [i for i in range(len(row) - n + 1) if all(row[i + j] == stretch[j] for j in range(n))]
        assert _at(row, stretch) == (places[0] if len(places) == 1 else None)
    for _ in range(200):  # bounded: each side the row's edge, a padding token, or an id the model pads or ends with
        row, real = rng.integers(0, 4, size=8), rng.random(8) < 0.7
        i, n = int(rng.integers(0, 6)), int(rng.integers(1, 3))
        left = "edge" if i == 0 else ("pad" if not real[i - 1] else int(row[i - 1]))
        right = "edge" if i + n == 8 else ("pad" if not real[i + n] else int(row[i + n]))
        assert _bounded(row, real, i, n, {0}) == (left in ("edge", "pad", 0) and right in ("edge", "pad", 0))


def test_trajectory_slots_hidden_at_generate_that_training_keeps_real_are_found(tmp_path):
    """Tsinghua-MARS-Lab/StateTransformer#93 (written blind, batch blind-ck): generate's last pass zeroes the attention
    mask over the trajectory slots; the program's training forward runs the same embeddings (inputs_embeds, no ids)
    through the same GPT2Model with an all-ones mask. Fixed: the all-ones mask."""
    [hit, *_] = check_bug(tmp_path, "statetransformer_generate_masks_future_trajectory_slots", "unlike-run-alone")
    assert hit["message"].startswith("the program runs batch row 0 (18 tokens) as row 0 of another call of transformer")
    assert "keeps tokens 10-17 real" in hit["message"] and "(token 10, handed as embeddings)" in hit["message"]
    assert hit["cell"] == [0, 10, 10]


def test_plan_slots_hidden_in_a_left_padded_batch_are_found(tmp_path):
    """Written another way: a hand-written planner GPT over token ids, a left-padded batch, an explicit softmax over
    causal AND the attention_mask; the planner zeroes the plan slots its training forward keeps real. Fixed: the
    collator's mask."""
    [hit, *_] = check_bug(tmp_path, "trajectory_planner_plan_slots_masked_left_padded", "unlike-run-alone", RUNALONE)
    assert "keeps tokens 7-10 real" in hit["message"] and "(token 7, id 1)" in hit["message"]
    assert hit["cell"] == [0, 7, 7]


def test_a_row_run_twice_is_said_only_where_the_second_run_cuts_it_short():
    """The tokens said against a loop over positions: each one the first run keeps and the second hides, said where
    every one of them lies after every token the second keeps and none is the pad id; a context hidden before a kept
    token (an ablation), a row hidden whole, or a pad id says nothing."""
    rng = np.random.default_rng(1)
    seen = 0
    for _ in range(500):
        row = rng.integers(0, 5, size=7)
        said, real = rng.random(7) < 0.85, rng.random(7) < 0.6
        pad = None if rng.random() < 0.3 else int(rng.integers(0, 5))
        hidden = [k for k in range(7) if said[k] and not real[k]]
        last_kept = max((k for k in range(7) if real[k]), default=None)
        cut = hidden and last_kept is not None and all(k > last_kept for k in hidden) \
            and not any(pad is not None and row[k] == pad for k in hidden)
        assert _cut_short(row, said, real, pad).tolist() == (hidden if cut else [])
        seen += bool(cut)
    assert seen > 20
