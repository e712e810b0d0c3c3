"""checks/padtail.py: a first decode step whose mask hides the prompt's last position (continued-from-padding), caught
in the published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/padtail),
quiet on the fixes; the flagged row against a loop over the prompts, the row reading against a plain loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.padtail import _rows

PADTAIL = Path(__file__).parent / "data" / "padtail"


def _first_short(lengths: list[int], width: int) -> int:
    """The first batch row whose prompt is shorter than the batch's padded width (its pads after its text)."""
    return next(b for b, n in enumerate(lengths) if n < width)


def test_an_rlhf_collator_that_leaves_the_pads_after_each_prompt_is_found(tmp_path):
    # deepspeedai/DeepSpeedExamples#457 (commit 9a586b1b): DataCollatorRLHF pads the flipped prompts with
    # pad=(pad_length, 0), so after the flip back every prompt is followed by pads (mask 0) before generate()
    found = check_bug(tmp_path, "deepspeed_chat_rlhf_collator_prompt_pad_after_prompt", "continued-from-padding")
    width = 10  # max_prompt_seq_len
    b = _first_short([7, 4, 6], width)
    assert tuple(found[0]["cell"]) == (b, width, width - 1)
    assert "3 such batch rows" in found[0]["message"]


def test_right_padded_prompts_handed_to_generate_are_found(tmp_path):
    # written another way: GPT-2 (SDPA), a hand-written collator padding on the right, the mask given to generate()
    found = check_bug(tmp_path, "gpt2_generate_right_padded_prompts", "continued-from-padding", folder=PADTAIL)
    lengths = [5, 3, 4]
    width = max(lengths)
    b = _first_short(lengths, width)
    assert tuple(found[0]["cell"]) == (b, width, width - 1)
    assert "keys 3-4" in found[0]["message"] and "2 such batch rows" in found[0]["message"]


def test_lmms_eval_qwen25_vl_batch_padded_on_the_right_for_generate(tmp_path):
    # EvolvingLMMs-Lab/lmms-eval#889 (commit 9a180ec6; written blind, round 51, caught before any rule was changed for
    # it): Qwen2_5_VL.generate_until left the processor's right padding on a batch of image + question prompts
    found = check_bug(tmp_path, "lmms_eval_qwen25vl_batched_generate_right_padding", "continued-from-padding")
    assert found[0]["message"].startswith("batch row 0: the first decode step's query (position 26)")
    assert "not keys 24-25, which the mask calls padding at the end of the 26-token prompt" in found[0]["message"]


def _loop(cells: np.ndarray, length: int) -> list[tuple[int, int]]:
    found = []
    for b in range(cells.shape[0]):
        row = [bool(x) for x in cells[b, 0]]
        steps = cells.shape[1]
        given = any(cells[b, q, length + j] for q in range(steps) for j in range(q + 1, steps))
        if row[length] and not row[length - 1] and any(row[:length - 1]) and not given:
            pads = 0
            while not row[length - 1 - pads]:
                pads += 1
            hidden = range(length - pads, length)  # (padding: hidden from every query of the step, not query 0's alone)
            if not any(cells[b, q, k] for q in range(cells.shape[1]) for k in hidden):
                found.append((b, pads))
    return found


def test_the_rows_read_match_a_plain_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        length = int(rng.integers(2, 8))
        cells = rng.random((3, 2, length + 2)) < 0.6
        assert _rows(cells, length) == _loop(cells, length)
    left = np.array([[[0, 0, 1, 1, 1, 1]]], bool)  # left padding: the prompt's last position real
    assert _rows(left, 4) == []


def test_keys_a_later_query_of_the_step_sees_are_no_padding():
    """speculators' EAGLE-3 training-time steps: query i of the step sees prompt keys 0 .. i and its own; query 0 hides
    keys 1-7, which query 7 sees: the prompt's, not padding (a false alarm on its fixed program before)."""
    length, q_len = 8, 8
    cells = np.zeros((1, q_len, length + q_len), bool)
    for i in range(q_len):
        cells[0, i, :i + 1] = True
        cells[0, i, length + i] = True
    assert _rows(cells, length) == _loop(cells, length) == []


def test_a_step_whose_queries_see_later_keys_of_the_step_is_no_decode():
    """lerobot's pi0: a cached prefix whose language is right padded, then the state and a 3-token action chunk whose
    queries see each other (block-causal from cumsum(att_masks)): given together, not decoded from the prefix's last
    query (a false alarm on the blind correct program before); a single-query step over the same prefix still found."""
    length, q_len = 6, 4
    cells = np.zeros((1, q_len, length + q_len), bool)
    cells[0, :, :4] = True  # four real prefix tokens, two pads
    cells[0, 0, length] = True  # the state sees itself
    cells[0, 1:, length:] = True  # the actions see the state and each other
    assert _rows(cells, length) == _loop(cells, length) == []
    assert _rows(cells[:, :1, :length + 1], length) == _loop(cells[:, :1, :length + 1], length) == [(0, 2)]


def test_an_action_chunk_over_a_cached_padded_prefix_is_quiet(tmp_path):
    """Written another way than the blind pi0 program (tests/data/quiet_blind): SmolVLA's denoising steps through SDPA,
    the whole action chunk bidirectional over [cached right-padded prefix | chunk]; flagged before."""
    from checkbugs import traced

    _, found, _ = traced(tmp_path, "smolvla_cached_prefix_action_chunk_sdpa", False, Path(__file__).parent / "data" / "quiet")
    assert [f for f in found if f["code"] == "continued-from-padding"] == []


def test_chattts_right_padded_prompts_decoded_from_a_pad_slot(tmp_path):
    # 2noise/ChatTTS e69ffac (written blind, blind-lh, round 66; caught before any rule was changed for it): the
    # tokenizer right-padded the batch of prompts its hand-written GPT decode loop continues, so the short prompt
    # ("hi.") drew its first audio code from one of its own pad slots
    found = check_bug(tmp_path, "chattts_tokenizer_right_padding_decode_from_pad_slot", "continued-from-padding")
    texts = ["hello there, how are you today.", "hi."]
    b, q, k = found[0]["cell"]
    assert b == _first_short([len(t) for t in texts], max(map(len, texts))) and k == q - 1


def test_haerae_hf_backend_batched_generate_right_padded_prompts(tmp_path):
    """HAE-RAE/haerae-evaluation-toolkit aaf7af0 (written blind, batch blind-mw; caught before any rule changed for
    it): the HuggingFace backend loaded its tokenizer with the default right padding and generated for several prompts
    at once, so shorter prompts were continued after their pad tokens. The fix pads on the left."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "haerae_hf_backend_batched_generate_right_padded_prompts", "continued-from-padding")[0]
    assert "the first decode step's query (position 53)" in " ".join(hit["message"].split())


def test_unsloth_vision_padding_side_set_on_the_processor_only(tmp_path):
    """unslothai/unsloth#1384 (written blind, batch blind-os; caught before any rule changed for it): the inference
    padding side was set on the processor object, so its text tokenizer still padded on the right and a batched
    generate continued the shorter prompt after its pads. The fix sets it on the tokenizer too."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "unsloth_vision_processor_padding_side_set_on_processor_not_tokenizer",
                    "continued-from-padding")[0]
    b, query, last = hit["cell"]
    assert (query, last) == (query, query - 1)  # (the first decode step sits right after the prompt's last column)
    assert f"the first decode step's query (position {query})" in " ".join(hit["message"].split())


def test_mlperf_llama2_reference_sut_right_pads_its_batched_prompts(tmp_path):
    """mlcommons/inference#1572 (fixes #1558; written blind, blind-ul, caught before any rule changed for it): the
    Llama-2 reference SUT padded each batch's prompts on the right (`F.pad(..., (0, max_seq_len - input_len))`, eos
    as the pad) and called generate, so a short prompt's first new token came from a pad slot. The fix pads left."""
    found = check_bug(tmp_path, "mlperf_llama2_sut_offline_batch_right_padded_generate", "continued-from-padding")
    lengths, width = [5, 8], 12  # (queries 1 and 2: 5 and 8 tokens padded to 12; query 0 fills the width)
    message = " ".join(found[0]["message"].split())
    assert f"batch row 1: the first decode step's query (position {width})" in message
    assert f"not keys {lengths[0]}-{width - 1}" in message and f"padding query's output (position {width - 1})" in message
