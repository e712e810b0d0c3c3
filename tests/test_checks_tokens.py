"""checks/tokens.py: the model call's attention_mask against its input ids and the pad id the program states (the
model's, else its tokenizer's), each rule caught in the published bug's reproduction (tests/data/bugs) and in a
program written another way (tests/data/tokens), quiet on the fixes; the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first
from maskcli.checks.tokens import _run_at_edge

TOKENS = Path(__file__).parent / "data" / "tokens"


def test_left_padding_with_pad_id_zero_left_unmasked_is_found(tmp_path):
    # NVIDIA-NeMo/Automodel#3704: rows [0, 5, 6, ...] and [0, 0, 0, 0, 5, ...], the attention_mask all ones
    found = check_bug(tmp_path, "automodel_package_example_left_padding_pad_id_zero", "padding-unmarked")
    pads = (1, 4)
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)
    assert "tok (_Tok) in main()" in found[0]["message"] and "left-padded" in found[0]["message"]


def test_a_mask_built_from_the_wrong_pad_id_of_an_embeddings_padding_idx_is_found(tmp_path):
    found = check_bug(tmp_path, "embedding_pad_idx_mask_from_zero", "padding-unmarked", folder=TOKENS)
    pads = (0, 3)
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)
    assert "the model's pad id (1)" in found[0]["message"]


def test_a_collator_mask_zero_over_every_response_token_is_found(tmp_path):
    # 0xallam/Direct-Preference-Optimization#1: ones for the prompt, zeros for the chosen / rejected ids
    found = check_bug(tmp_path, "dpo_collate_masks_out_response_tokens", "real-tokens-masked")
    assert "WordTokenizer" in found[0]["message"]
    b, q, k = found[0]["cell"]
    assert k <= q


def test_an_sft_mask_built_from_the_labels_is_found(tmp_path):
    found = check_bug(tmp_path, "mask_from_labels_hides_prompt", "real-tokens-masked", folder=TOKENS)
    prompt = (4, 2)  # the prompt tokens, labels -100: masked; a later query does not see them
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: k < prompt[b] and k < q)


def test_a_pad_run_is_one_run_at_one_edge_of_every_row():
    left = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
    assert _run_at_edge(left, None) and _run_at_edge(left, "left") and not _run_at_edge(left, "right")
    assert _run_at_edge(left[:, ::-1], "right")
    assert not _run_at_edge(np.array([[0, 1, 0, 0]], bool), None)  # the pad id inside the text: not padding
