"""checks/pooledend.py: a causal model's output pooled before some rows' end by a read that lands on other rows' end
(pooled-before-end), and trace/poolrows.py's following of a model call inside the outermost one handed an expanded key
padding mask, through a final layer norm."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import traced

BLIND = Path(__file__).parent / "data" / "blind"
BUGS = Path(__file__).parent / "data" / "bugs"
POOLED = Path(__file__).parent / "data" / "pooled"


def _ends(prompts: list[list[int]]) -> list[int]:
    """Each row's last real token (right padding), by a plain loop."""
    return [len(p) - 1 for p in prompts]


def test_clip_text_tower_pooled_at_the_largest_id_is_found(tmp_path):
    """transformers#24777 (written blind, blind-ic, round 56; caught after tuning): CLIPTextTransformer pooled at
    `input_ids.argmax(-1)`; a textual-inversion token (id 40 > eos 39) outranks the EOS in two of three prompts. The
    read is made inside the model, on CLIPEncoder's output (handed the expanded (B, 1, L, L) padding mask) through the
    final layer norm; heads folded into the batch (bsz * heads)."""
    status, found, report = traced(tmp_path, "transformers_clip_text_pooled_at_argmax_id_not_eos", False, BLIND)
    hits = [f for f in found if f["code"] == "pooled-before-end"]
    assert status == 1 and len(hits) == 1 and hits[0]["severity"] == "wrong", report
    prompts = [[38, 3, 7, 11, 40, 15, 3, 21, 39], [38, 3, 40, 25, 39], [38, 3, 7, 11, 3, 30, 39]]  # bos ... eos
    at = [max(range(len(p)), key=lambda i: p[i]) for p in prompts]  # the largest id's place, by a loop
    early = [b for b in range(3) if at[b] < _ends(prompts)[b]]
    assert early == [0, 1] and tuple(hits[0]["cell"]) == (0, at[0], at[0])
    assert "CLIPEncoder's output" in hits[0]["message"] and "largest id" in hits[0]["message"]
    status, found, report = traced(tmp_path, "transformers_clip_text_pooled_at_argmax_id_not_eos", True, BLIND)
    assert not [f for f in found if f["code"] == "pooled-before-end"], report


def test_a_tower_pooled_outside_the_model_at_the_largest_id_is_found_and_its_fix_quiet(tmp_path):
    """Written another way: SDPA over a bool causal + key padding mask, the (B, L, D) output pooled by the caller."""
    prompts = [[3, 7, 20, 11, 5, 19], [4, 9, 2, 8, 6, 1, 12, 19], [5, 20, 14, 19]]
    status, found, report = traced(tmp_path, "causal_text_tower_pooled_at_largest_id", False, POOLED)
    [hit] = [f for f in found if f["code"] == "pooled-before-end"]
    at = [max(range(len(p)), key=lambda i: p[i]) for p in prompts]
    assert status == 1 and tuple(hit["cell"]) == (0, at[0], at[0]) and at[1] == _ends(prompts)[1], report
    assert "(and row 2)" in hit["message"] and "pooled at its last token (7)" in hit["message"]
    status, found, report = traced(tmp_path, "causal_text_tower_pooled_at_largest_id", True, POOLED)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_a_tower_attending_both_ways_or_read_at_each_prompts_end_is_quiet(tmp_path):
    """No causal part (a position sees every token), or no row read at its end (a prompt's last token, the response
    after it): the read says nothing of where the rows end."""
    for flag in ("--both-ways", "--prompt-end"):
        status, found, report = traced(tmp_path, "causal_text_tower_pooled_at_largest_id", False, POOLED, (flag,))
        assert not [f for f in found if f["code"] == "pooled-before-end"], report


def test_an_expanded_key_padding_mask_states_its_rows_tokens_by_the_keys_it_keeps():
    from maskcli.trace.poolrows import _rows_seeing

    mask = torch.zeros(3, 1, 5, 5)
    mask[1, :, :, 3:] = torch.finfo(torch.float32).min  # row 1: 3 tokens, right-padded, every query row alike
    assert _rows_seeing(mask).tolist() == [[True] * 5, [True] * 3 + [False] * 2, [True] * 5]
    assert _rows_seeing(mask[:, :, :1]).tolist() == [[True] * 5, [True] * 3 + [False] * 2, [True] * 5]  # (B, 1, 1, L)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    causal[1, :, :2] = False  # rows that differ: the queries that see some key, as before
    assert _rows_seeing(causal).tolist() == [[True] * 5, [False] * 2 + [True] * 3]


def test_sentence_transformers_lasttoken_read_through_the_masked_output(tmp_path):
    """sentence-transformers#2111 (written blind, caught now): lasttoken pooling gathered `token_embeddings *
    input_mask_expanded` at `argmin(attention_mask) - 1`, clamped to 0: the unpadded row (8 tokens) is read at its
    first token. The product by the mask is followed as the same output (trace/poolrows.py)."""
    status, found, report = traced(tmp_path, "sentence_transformers_lasttoken_pooling_unpadded_row_takes_first_token",
                                   False, BUGS)
    [hit] = [f for f in found if f["code"] == "pooled-before-end"]
    lengths = [8, 3, 5]
    index = [max(0, next((i for i in range(8) if i >= n), 0) - 1) for n in lengths]  # argmin of each row's mask - 1
    assert status == 1 and index == [0, 2, 4] and tuple(hit["cell"]) == (0, index[0], index[0]), report
    status, found, report = traced(tmp_path, "sentence_transformers_lasttoken_pooling_unpadded_row_takes_first_token",
                                   True, BUGS)
    assert status == 0 and not [f for f in found if f["code"] == "pooled-before-end"], report


def test_a_masked_output_read_by_index_before_an_unpadded_rows_end(tmp_path):
    """Written another way: `attention_mask[..., None] * hidden` (the mask first), read `[arange(B), index]`."""
    status, found, report = traced(tmp_path, "decoder_embedder_masked_output_pooled_at_length", False, POOLED)
    [hit] = [f for f in found if f["code"] == "pooled-before-end"]
    assert status == 1 and tuple(hit["cell"]) == (0, 0, 0), report
    status, found, report = traced(tmp_path, "decoder_embedder_masked_output_pooled_at_length", True, POOLED)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_minimind_ppo_critic_read_at_each_rows_length_less_one(tmp_path):
    """jingyaogong/minimind 9c98cab / d7f4f4e (written blind, batch blind-zf; missed before): the PPO critic's value is
    read at `full_mask.sum(1) - 1` over left-padded prompts and their responses, a real token before row 0's last; the
    fix reads `(full_mask * arange).argmax(1)`."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "minimind_ppo_left_padded_prompt_lengths_from_attention_mask", "pooled-before-end")[0]
    assert "its length less one" in hit["message"] and "padded on the left" in hit["message"]


def test_a_value_head_read_at_length_less_one_written_another_way(tmp_path):
    """A hand-written causal decoder and value head over prompts of 9, 7 and 6 tokens padded on the left to 9: read at
    `attention_mask.sum(-1) - 1`, rows 1 and 2 are read at a real token before their last (6 of 2-8, 5 of 3-8); the
    fix reads the last column. Against the positions a double loop gives."""
    from checkbugs import check_bug

    lengths, width = [9, 7, 6], 9
    read = [n - 1 for n in lengths]
    early = [r for r, n in enumerate(lengths) if width - n > 0 and read[r] != width - 1]
    [hit] = check_bug(tmp_path, "value_head_left_padded_read_at_length_less_one", "pooled-before-end", POOLED)
    assert hit["message"].startswith(f"batch row {early[0]} of Decoder's output is read at position {read[early[0]]}")
    assert tuple(hit["cell"]) == (early[0], read[early[0]], read[early[0]])
