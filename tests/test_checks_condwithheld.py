"""checks/condwithheld.py: a conditioned decoder whose generation never hands it the conditioning its caller holds,
caught in the published bug's reproduction (tests/data/bugs) and in a program written another way
(tests/data/condwithheld), quiet on the fixes and on a loop that fuses the prefix into the inputs itself."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

HERE = Path(__file__).parent / "data" / "condwithheld"


def test_musicgen_melody_pre_created_cache_drops_the_conditioning_prefix_at_step_0(tmp_path):
    """huggingface/transformers#48679 (written blind, batch blind-fl): generate pre-creates an empty DynamicCache, so
    prepare_inputs_for_generation's `past_key_values is not None` guard drops encoder_hidden_states at step 0 too."""
    found = check_bug(tmp_path, "musicgen_melody_pre_created_cache_drops_conditioning_prefix_at_step0",
                      "conditioning-never-attended")
    # upstream meaning: step 0's queries see the 8 chroma + 5 text prefix positions before their own token; with the
    # prefix dropped, the first query of the first step sees its own token alone (2 rows x 2 CFG halves x 4 codebooks
    # folded as 4 rows of the decoder's batch, 1 query, 1 key)
    assert tuple(found[0]["cell"]) == first((4, 1, 1), lambda b, q, k: k == q)
    message = found[0]["message"]
    assert "takes `encoder_hidden_states`, and generate() of" in message
    assert "holds it (2, 13, 64), but none of the model's 11 calls was handed it" in message  # max_length 12, 1 given
    assert "a fresh pass whose cache is empty (1 query over 1 key" in message


def test_a_prefix_captioner_whose_loop_makes_its_cache_before_the_first_step_is_found(tmp_path):
    found = check_bug(tmp_path, "prefix_captioner_cache_made_before_loop_drops_prefix", "conditioning-never-attended",
                      folder=HERE)
    assert tuple(found[0]["cell"]) == first((2, 1, 1), lambda b, q, k: k == q)
    assert "takes `prefix_embeds`, and caption() of" in found[0]["message"]
    assert "holds it (2, 6, 32), but none of the model's 6 calls was handed it" in found[0]["message"]


def test_a_loop_that_fuses_the_prefix_into_inputs_embeds_itself_is_quiet(tmp_path):
    status, found, report = traced(tmp_path, "prefix_captioner_fuses_prefix_into_inputs_embeds", False, HERE)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "(2,4,7,7)" in report  # its first pass attends the 6 prefix positions and the first token
