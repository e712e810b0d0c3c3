"""checks/shortmask.py: a model call's 2-D attention_mask that stops before its own tokens, or marks them padding, their
own keys hidden."""

from __future__ import annotations

import pytest

from checkbugs import ROWS, caught, check_bug, traced


def _buggy_allows(p: int, row_ids: list[int], width: int) -> list[bool]:
    """What the buggy loop lets the query at position p see: a double loop over keys 0 .. p, the prompt's mask (width
    columns, 0 at a padding id) padded with zeros past its end, and causal."""
    return [k <= p and (k < width and row_ids[k] != 0) for k in range(p + 1)]


def test_a_hand_written_loop_that_never_extends_the_mask(tmp_path):
    """Written otherwise: an eager softmax whose model pads the 2-D mask with zeros up to the keys (as transformers
    does), left-padded prompts of 3 and 5 tokens, the prompt's mask handed at every step. Against a loop over absolute
    positions: the first decode query, at position 5, does not see key 5 (itself) in batch row 0."""
    hit = caught(tmp_path, "generate_loop_mask_not_extended", ("attention-mask-short",))
    seen = _buggy_allows(5, [0, 0, 7, 8, 9], 5)
    assert not seen[5] and any(seen)
    assert "handed an attention_mask of width 5, but places its queries at cache_position 5" in hit["message"]
    assert "query 5 of batch row 0 does not see its own key" in hit["message"]
    assert hit["expected"].startswith("an attention_mask of width 6 or more") and hit["cell"] == [0, 5, 5]


def test_a_model_that_extends_the_mask_itself_is_quiet(tmp_path):
    """The same loop handing the prompt's mask, but the model appends ones for the tokens it is fed: each query sees
    its own key, nothing is short."""
    status, found, report = traced(tmp_path, "generate_loop_mask_not_extended", False, ROWS, ("--inside",))
    assert status == 0 and not [f for f in found if f["code"] == "attention-mask-short"], report


@pytest.mark.parametrize("args", [(), ("--positions",)])
def test_transformers_llama_decoded_by_hand_with_the_prompt_mask(tmp_path, args):
    """transformers' own masking (LlamaForCausalLM from its config class, a DynamicCache): a prompt-length mask is
    padded with zeros there too. With cache_position handed or left to the model, the first decode query (position 5)
    is said, and the fix (a 1 appended a step) is quiet."""
    hits = check_bug(tmp_path, "hf_llama_loop_mask_not_extended", "attention-mask-short", ROWS, args)
    word = "cache_position" if args else "position"
    assert f"places its queries at {word} 5:" in hits[0]["message"]
    assert "query 5 of batch row 0 does not see its own key" in hits[0]["message"]


def test_tt_xla_static_cache_prompt_length_mask(tmp_path):
    """tenstorrent/tt-xla#2953 (written blind): a prompt-length mask against a StaticCache of max_cache_len; the fix
    pre-allocates a mask of the cache's length."""
    hits = check_bug(tmp_path, "ttxla_llama_static_cache_prompt_length_attention_mask", "attention-mask-short")
    assert "attention_mask of width 8, but places its queries at cache_position 8" in hits[0]["message"]


def test_a_sampling_loop_that_appends_the_finished_flag(tmp_path):
    """Written otherwise: SDPA with a boolean mask, an embedding whose padding_idx is 0 (the model's pad id), a loop
    that appends `finished.long()` where it means `~finished`. Against a loop over absolute positions: at the first
    decode step no row has finished, so position 4 (after a 4-token prompt) is marked 0 and its query, a real token,
    does not see key 4."""
    hit = caught(tmp_path, "generate_loop_mask_extended_with_finished_flag", ("own-token-masked",))
    finished = [False, False]
    appended = [int(f) for f in finished]  # (the buggy loop's column 4)
    p = 4
    seen = [k <= p and (k < p or appended[0] == 1) for k in range(p + 1)]
    assert not seen[p] and "at position 4, but its attention_mask marks position 4 padding (0)" in hit["message"]
    assert "feeds batch row 0 token id" in hit["message"] and "the model's pad id (0)" in hit["message"]
    assert hit["expected"] == "attention_mask[0, 4] = 1 (a token fed is a token)"


def test_transformers_llama_decoded_by_hand_with_zeros_appended(tmp_path):
    """transformers' LlamaForCausalLM (pad_token_id 0 in its config) decoded by hand, a 0 appended to the mask for
    each token fed: the first decode query (position 5) is marked padding and blind to itself; ones appended are
    quiet."""
    hits = check_bug(tmp_path, "hf_llama_loop_mask_not_extended", "own-token-masked", ROWS, ("--zeros",))
    assert "at position 5, but its attention_mask marks position 5 padding (0)" in hits[0]["message"]


def test_cosyvoice2_one_step_mask_covers_the_new_token_only(tmp_path):
    """filliptm/ComfyUI_FL-CosyVoice3#7 (written blind, batch blind-pc; caught before any rule changed for it):
    CosyVoice 2's speech LM handed each cached step `masks[:, -1, :]` of a mask over its own input only, one column
    where the cache holds the prompt; transformers read the missing columns as padding. The fix hands a mask as long as
    the cache and the new token."""
    from checkbugs import check_bug

    check_bug(tmp_path, "cosyvoice2_qwen2lm_forward_one_step_mask_covers_new_token_only", "attention-mask-short")
