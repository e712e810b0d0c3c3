"""checks/tokens.py: the model call's attention_mask against its input ids and the pad id the program states (the
model's, else its tokenizer's), each rule caught in the published bug's reproduction (tests/data/bugs) and in a
program written another way (tests/data/tokens), quiet on the fixes; the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import pytest

import maskcli
from checkbugs import check_bug, first, traced
from maskcli.checks.tokens import _run_at_edge

TOKENS = Path(__file__).parent / "data" / "tokens"
UNIFORM = Path(__file__).parent / "data" / "uniform"


def test_left_padding_with_pad_id_zero_left_unmasked_is_found(tmp_path):
    # NVIDIA-NeMo/Automodel#3704: rows [0, 5, 6, ...] and [0, 0, 0, 0, 5, ...], the attention_mask all ones
    found = check_bug(tmp_path, "automodel_package_example_left_padding_pad_id_zero", "padding-unmarked")
    pads = (1, 4)
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)
    assert "tok (_Tok) in main()" in found[0]["message"] and "left-padded" in found[0]["message"]


def test_a_mask_carried_over_from_another_input_is_said_as_one(tmp_path):
    # PixArt-alpha/PixArt-sigma commit d5adc75 (blind-ea): the null prompt "" (ids [</s>, pad, ...]) T5-encoded with
    # txt_tokens.attention_mask, the last validation prompt's (15 tokens), so its pad tokens are attended
    found = check_bug(tmp_path, "pixart_sigma_train_null_embed_encoded_with_prompt_mask", "padding-unmarked")
    assert tuple(found[0]["cell"]) == first((1, 24, 24), lambda b, q, k: q < 1 <= k < 15)
    assert "another input's attention_mask" in found[0]["message"]
    # written another way: a retrieval evaluation's queries encoded by BERT with the passages' mask (11 and 10 tokens)
    found = check_bug(tmp_path, "retrieval_queries_encoded_with_passages_mask", "padding-unmarked", folder=TOKENS)
    real, marked = (7, 5), (11, 10)
    assert tuple(found[0]["cell"]) == first((2, 12, 12), lambda b, q, k: q < real[b] <= k < marked[b])
    assert "another input's attention_mask" in found[0]["message"] and "(attention calls 0-1)" in found[0]["message"]


def test_a_preference_collators_ones_over_left_padded_ids_is_found(tmp_path):
    # PKU-Alignment/align-anything#96 (commit 9df86b9; written blind, batch blind-dm): better + worse rows left-padded
    # to 17 by the processor, the mask rebuilt as new_ones() over those ids
    found = check_bug(tmp_path, "alignanything_llava_dpo_collator_all_ones_mask_left_padding", "padding-unmarked")
    pads = tuple(17 - n for n in (13, 14, 10, 17))  # [bos] + prompt (5, 8) + better (6 + eos, 4 + eos) / worse (3, 7)
    assert tuple(found[0]["cell"]) == first((4, 17, 17), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)
    assert "LlamaForCausalLM" in found[0]["message"] and "ones_like the ids" in found[0]["message"]


def test_an_all_ones_mask_over_rows_left_padded_by_flipping_is_found(tmp_path):
    found = check_bug(tmp_path, "preference_left_padded_ones_like_ids_mask", "padding-unmarked", folder=TOKENS)
    pads = tuple(10 - n for n in (7, 8, 5, 10))  # chosen rows then rejected rows, flipped, padded, flipped back
    assert tuple(found[0]["cell"]) == first((4, 10, 10), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)
    assert "the model's pad id (3)" in found[0]["message"]


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


def test_a_dpo_collator_of_ones_then_zeros_over_chosen_and_rejected_is_found(tmp_path):
    # 0xallam/Direct-Preference-Optimization#2 (fixes #1; written blind, batch blind-dm): prompts of 6 unpadded, chosen
    # of 9, 4, 7 right-padded; the mask cat(ones_like(prompt), zeros_like(chosen)) hides every chosen token
    found = check_bug(tmp_path, "dpo_0xallam_train_collate_mask_zeroes_responses", "real-tokens-masked")
    chosen = (9, 4, 7)
    assert tuple(found[0]["cell"]) == first((3, 15, 15), lambda b, q, k: 6 <= k < 6 + chosen[b] and k <= q)
    assert "PhiForCausalLM" in found[0]["message"] and "the model's pad id (0)" in found[0]["message"]


def test_a_kto_mask_of_zeros_over_the_completion_after_a_left_padded_prompt_is_found(tmp_path):
    found = check_bug(tmp_path, "kto_left_padded_prompt_mask_zeros_completion", "real-tokens-masked", folder=TOKENS)
    completion = (5, 3)  # after prompts left-padded to 6, each completion right-padded to 5
    assert tuple(found[0]["cell"]) == first((2, 11, 11), lambda b, q, k: 6 <= k < 6 + completion[b] and k <= q)
    assert "8 tokens it masks are text" in found[0]["message"]


def test_an_sft_mask_built_from_the_labels_is_found(tmp_path):
    found = check_bug(tmp_path, "mask_from_labels_hides_prompt", "real-tokens-masked", folder=TOKENS)
    prompt = (4, 2)  # the prompt tokens, labels -100: masked; a later query does not see them
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: k < prompt[b] and k < q)


def test_a_mask_from_the_ids_that_hides_each_chat_turns_eos_is_found(tmp_path):
    # OpenRLHF 01b8a23d: `seq != eos & seq != pad` hides the <|eot_id|> closing each turn inside the prompt; the pad id is
    # the program's top-level PAD_TOKEN_ID
    found = check_bug(tmp_path, "openrlhf_actor_process_sequences_masks_eos_inside_prompt", "real-tokens-masked")
    eos_inside = ({3, 6}, {6})  # the prompts' turn-closing eos ids (9), not the pad id 0
    assert tuple(found[0]["cell"]) == first((2, 13, 13), lambda b, q, k: k in eos_inside[b] and k <= q)
    assert "PAD_TOKEN_ID=0 at the top of" in found[0]["message"] and "all of id 9" in found[0]["message"]


def test_a_chatml_collator_mask_that_drops_every_im_end_is_found(tmp_path):
    found = check_bug(tmp_path, "chatml_collator_mask_drops_im_end_turns", "real-tokens-masked", folder=TOKENS)
    ends = ({4, 8, 13}, {3, 8})  # <|im_end|> (6) of each turn; the config's pad id is 2
    assert tuple(found[0]["cell"]) == first((2, 14, 14), lambda b, q, k: k in ends[b] and k <= q)
    assert "the model's pad id (2)" in found[0]["message"]


def test_pads_a_finished_sample_kept_as_response_are_found(tmp_path):
    # huggingface/trl#487: row 1's response keeps the pad (= eos, id 1) tokens generation appended, attention_mask 1,
    # while row 0's collator padding is 0; the padded queries (scored as response) see them
    found = check_bug(tmp_path, "trl_ppo_batched_generation_keeps_pad_tokens_in_response", "padding-unmarked")
    kept = ((), (9, 10))  # past the first token of each row's run of id 1 (8 .. 10), which closes the text
    assert tuple(found[0]["cell"]) == first((2, 11, 11), lambda b, q, k: k in kept[b] and k <= q)
    assert "marks the same run padding in batch row 0" in found[0]["message"] and "padded queries only" in found[0]["message"]


def test_a_reward_batch_that_keeps_a_rollouts_padding_is_found(tmp_path):
    found = check_bug(tmp_path, "reward_batch_keeps_rollout_padding", "padding-unmarked", folder=TOKENS)
    kept = ((8, 9), ())  # row 0 ends 2, 0, 0, 0 (EOS, then the rollout's pads marked 1); row 1's collator pads are 0
    assert tuple(found[0]["cell"]) == first((2, 10, 10), lambda b, q, k: k in kept[b] and k <= q)
    assert "the model's pad id (0)" in found[0]["message"]


def test_a_rollout_mask_cut_only_at_the_tokenizers_eos_is_found(tmp_path):
    # verl-project/verl#213 (fixes #212): get_eos_mask stops at tokenizer.eos_token_id (2) only; responses vLLM stopped
    # at generation_config's other eos (7) keep their right padding (id 0) at mask 1, row 1's (stopped at 2) at 0
    found = check_bug(tmp_path, "verl_vllm_rollout_response_mask_tokenizer_eos_only", "padding-unmarked")
    prompt, responses = 4, ([21, 22, 7], [23, 24, 25, 2], [26, 27, 28, 29, 7])
    kept = tuple(range(prompt + len(r) + 1, 12) if r[-1] == 7 else () for r in responses)  # past the first pad
    assert tuple(found[0]["cell"]) == first((3, 12, 12), lambda b, q, k: k in kept[b] and k <= q)
    assert "marks the same run padding in batch row 1" in found[0]["message"]


def test_a_chat_rollout_mask_cut_only_at_the_eos_not_at_im_end_is_found(tmp_path):
    # written another way: the stop ids a chat sampler used (<|im_end|> 7, EOS 2), the mask cut at the EOS alone, row
    # by row; prompts unpadded, a Llama critic (eager), the pad id the tokenizer's
    found = check_bug(tmp_path, "chat_rollout_mask_stops_at_tokenizer_eos_only", "padding-unmarked", folder=TOKENS)
    kept = ((8, 9), (), ())  # row 0: 30, 31, 7, then pads 0 at 7 .. 9 (past the first); row 2 ends on 7 unpadded
    assert tuple(found[0]["cell"]) == first((3, 10, 10), lambda b, q, k: k in kept[b] and k <= q)
    assert "marks the same run padding in batch row 1" in found[0]["message"]


def test_a_pad_run_is_one_run_at_one_edge_of_every_row():
    left = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
    assert _run_at_edge(left, None) and _run_at_edge(left, "left") and not _run_at_edge(left, "right")
    assert _run_at_edge(left[:, ::-1], "right")
    assert not _run_at_edge(np.array([[0, 1, 0, 0]], bool), None)  # the pad id inside the text: not padding


def test_a_language_model_tutorial_run_without_its_causal_mask_is_found(tmp_path):
    # pytorch/tutorials#2478: model(data) with no src_mask; the loss's targets are the ids one position on
    found = check_bug(tmp_path, "tutorial_transformer_lm_encoder_without_causal_mask", "sees-its-target")
    assert tuple(found[0]["cell"]) == first((10, 35, 35), lambda b, q, k: k == q + 1)
    assert "shifted by one; 340 such queries" in found[0]["message"]  # 34 queries with a next key, 10 sequences


def test_pix2struct_text_decoder_config_not_a_decoder_trained_on_shifted_labels_is_found(tmp_path):
    # huggingface/transformers#23051 (written blind, batch blind-bq): Pix2StructTextConfig left is_decoder=False, so
    # get_extended_attention_mask made a padding-only mask over an unpadded batch: the decoder's softmax masks nowhere,
    # while its forward's loss takes `labels`, the decoder inputs being those labels shifted right
    found = check_bug(tmp_path, "pix2struct_text_decoder_not_causal_in_training", "sees-its-target")
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: k == q + 1)
    assert "input ids of Pix2StructTextModel shifted by one; 12 such queries" in found[0]["message"]  # 6 a row


def test_a_seq2seq_decoder_whose_einsum_softmax_masks_nowhere_under_its_labels_loss_is_found(tmp_path):
    found = check_bug(tmp_path, "seq2seq_decoder_einsum_softmax_no_mask_labels_in_forward", "sees-its-target",
                      folder=TOKENS)
    trained = (5, 4, 5)  # labels -100 from 4 (row 1) and 5 (row 2): query q's target counts where labels[q] is real
    counted = [(b, q) for b in range(3) for q in range(5) if q < trained[b]]
    assert tuple(found[0]["cell"]) == first((3, 6, 6), lambda b, q, k: k == q + 1 and (b, q) in counted)
    assert f"{len(counted)} such queries" in found[0]["message"]


def test_a_padded_gpt_whose_loss_is_shifted_inside_the_batch_is_found(tmp_path):
    found = check_bug(tmp_path, "gpt_loss_shifted_padding_mask_only", "sees-its-target", folder=TOKENS)
    lengths = (6, 4)  # a target counts where the next token is real (labels -100 on the padding)
    counted = [(b, q) for b in range(2) for q in range(5) if q + 1 < lengths[b]]
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: k == q + 1 and (b, q) in counted)
    assert f"{len(counted)} such queries" in found[0]["message"]


def test_a_model_whose_first_argument_is_its_ids_by_another_name_and_one_head_sees_the_next_note_is_found(tmp_path):
    # `forward(self, notes, targets)`: the ids are named as no transformers model names them; the targets the loss
    # inside the forward takes are those ids shifted by one. One head of four sees every later note: a query sees its
    # target in some head, so it is said (the cells are those of any head)
    found = check_bug(tmp_path, "music_lm_first_argument_one_head_sees_next_note", "sees-its-target", folder=TOKENS)
    assert tuple(found[0]["cell"]) == first((3, 10, 10), lambda b, q, k: k == q + 1)
    assert "the `notes` of NoteLM shifted by one; 27 such queries" in found[0]["message"]


def test_a_padding_mask_that_replaced_an_mlx_ports_causal_mask_under_a_next_token_loss_is_found(tmp_path):
    # unslothai/unsloth-zoo#963 (bug A): mlx-vlm's `__call__(inputs, mask=...)` takes a supplied padding mask as the
    # whole mask; the modules define `__call__`, not `forward` (trace reads their calls all the same)
    found = check_bug(tmp_path, "unsloth_zoo_mlx_vlm_loss_padding_mask_replaces_causal", "sees-its-target")
    real = 9 - 1  # 9 tokens padded to 12, fed [:-1]: 11 keys; query q's target is token q + 1, real up to query 7
    assert tuple(found[0]["cell"]) == first((1, 11, 11), lambda b, q, k: k == q + 1 and q < real)
    assert "input ids of LanguageModel shifted by one; 8 such queries" in found[0]["message"]


def test_a_port_whose_modules_define_call_trained_on_next_tokens_with_key_padding_only_is_found(tmp_path):
    found = check_bug(tmp_path, "nnx_port_call_loss_key_padding_only", "sees-its-target", folder=TOKENS)
    lengths = (6, 8)  # right-padded with 0, the loss's ignore_index: a target counts where the next token is real
    counted = [(b, q) for b in range(2) for q in range(7) if q + 1 < lengths[b]]
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: k == q + 1 and (b, q) in counted)
    assert f"input ids of TinyLM shifted by one; {len(counted)} such queries" in found[0]["message"]

def test_an_encoders_mask_computed_after_padding_held_inside_a_wrapper_is_found(tmp_path):
    # thunlp/FewRel#17: the wrapper is handed a dict; BertModel.forward(input_ids, attention_mask) holds all-ones
    found = check_bug(tmp_path, "fewrel_bert_encoder_mask_computed_after_padding", "padding-unmarked")
    lengths = (6, 10)  # [CLS] + 5 and [CLS] + 9 tokens, right-padded with the embedding's padding_idx 0 to 12
    assert tuple(found[0]["cell"]) == first((2, 12, 12), lambda b, q, k: q < lengths[b] <= k)
    assert f"{sum(n * (12 - n) for n in lengths)} such cells" in found[0]["message"]
    assert "attention_mask in forward() of" in found[0]["message"] and "(input_ids;" in found[0]["message"]


def test_a_mask_built_inside_the_encoder_from_the_wrong_pad_id_on_a_left_padded_dict_batch_is_found(tmp_path):
    found = check_bug(tmp_path, "wrapper_dict_batch_mask_wrong_pad_id_left", "padding-unmarked", folder=TOKENS)
    pads = (3, 0)  # left-padded with the config's pad_token_id 1
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: q >= pads[b] > k)
    assert "a token at the model's pad id (1)" in found[0]["message"] and "(tokens; 12 such cells)" in found[0]["message"]

def test_targets_are_read_as_the_ids_one_position_on_along_either_axis():
    from maskcli.trace.losses import _shifted

    ids = np.array([[5, 9, 3, 14], [8, 11, 6, 2]])
    axis, predicts = _shifted(ids[:, 1:].reshape(-1), ids, -100)  # transformers' shift inside the loss
    assert axis == 1 and predicts[:, :3].all() and not predicts[:, 3].any()
    first_seq = ids.T  # (sequence, batch), as nn.Transformer's tutorial lays it out
    target = np.concatenate([first_seq[1:], [[1, 1]]]).reshape(-1)  # the next row, flattened
    axis, predicts = _shifted(target, first_seq, -100)
    assert axis == 0 and predicts[:3].all() and not predicts[3].any()
    assert _shifted(ids.reshape(-1), ids, -100) is None  # the ids themselves: a copy task, no next-token claim
    masked = ids[:, 1:].copy()
    masked[1, :] = -100
    assert _shifted(masked.reshape(-1), ids, -100)[1][1].sum() == 0  # ignored targets judge nothing


def test_a_collator_padding_mask_true_on_the_real_audio_is_found(tmp_path):
    # earthspecies/avex#26: pad_or_window's mask True on the waveform, BEATs reads True as padding
    found = check_bug(tmp_path, "avex_beats_padding_mask_inverted_polarity", "padding-inverted")
    lengths = (900, 1300)  # samples of each clip; F.pad fills the rest of 1600 with zeros
    assert f"batch row 0: {1600 - lengths[0]} zero positions called real" in found[0]["message"]
    assert "padding_mask given to BEATs" in found[0]["message"] and "`source`" in found[0]["message"]


def test_an_attention_mask_built_from_the_zero_frames_of_left_padded_features_is_found(tmp_path):
    found = check_bug(tmp_path, "features_attention_mask_from_zero_frames", "padding-inverted", folder=TOKENS)
    assert "batch row 1: 3 zero positions called real" in found[0]["message"]  # 7 frames, 4 real, left-padded


def test_the_tokenizer_is_read_from_the_calling_frames_once_and_only_where_one_is_meant():
    import dataclasses
    from types import SimpleNamespace

    import torch

    import maskcli

    class Tiny(torch.nn.Module):
        def forward(self, input_ids):
            x = torch.randn(*input_ids.shape, 4)[:, None]
            return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)

    def run(*tokenizers):  # (the tokenizers are this frame's variables, as a program holds them)
        held = list(tokenizers)  # noqa: F841 - read by the trace from this frame
        first = tokenizers[0] if tokenizers else None  # noqa: F841
        second = tokenizers[1] if len(tokenizers) > 1 else None  # noqa: F841
        with maskcli.trace() as t:
            Tiny()(torch.tensor([[0, 5, 6], [7, 8, 9]]))
        return t.tops[0].arguments

    left = SimpleNamespace(pad_token_id=0, eos_token_id=2, padding_side="left")
    found = run(left)
    assert (found["tokenizer_pad_id"], found["tokenizer_eos_id"], found["padding_side"]) == (0, 2, "left")
    assert "first (SimpleNamespace) in run()" in found["tokenizer"]
    assert "tokenizer_pad_id" not in run(left, SimpleNamespace(pad_token_id=1, eos_token_id=2))  # two that differ
    del left  # (this frame is one the trace searches too)
    assert "tokenizer_pad_id" not in run(SimpleNamespace(pad_token_id=0))  # no eos id, no side: not a tokenizer

    @dataclasses.dataclass
    class EngineConfig:  # a config of the program's own that pads its batches (verl's): its pad id alone is read
        pad_token_id: int = 4

    found = run(EngineConfig())
    assert found["tokenizer_pad_id"] == 4 and "first (EngineConfig) in run()" in found["tokenizer"]


def test_a_collator_that_pads_the_attention_masks_with_the_pad_id_is_found(tmp_path):
    # SeanLee97/AnglE#89: the masks padded by tokenizer.pad as if ids, with pad_token_id=1: the padding marked real
    found = check_bug(tmp_path, "angle_collator_pads_attention_mask_with_pad_token_id", "padding-unmarked")
    lengths = (5, 3, 4, 6)  # the four texts of the two pairs, right-padded to 6 with id 1
    real = lambda b, i: i < lengths[b]  # noqa: E731
    assert tuple(found[0]["cell"]) == first((4, 6, 6), lambda b, q, k: real(b, q) and not real(b, k))
    assert "(22 such cells)" in found[0]["message"] and "pad id (1)" in found[0]["message"]


def test_the_same_collator_bug_written_by_another_hand(tmp_path):
    """SeanLee97/AnglE#89 written blind again (batch blind-ar): the collator's masks padded with the pad id 1 and
    handed to a transformers RobertaModel: caught as the first writing is, its fix quiet."""
    check_bug(tmp_path, "angle_collator_mask_padded_with_pad_id_written_again", "padding-unmarked")


def test_the_same_collator_bug_written_blind_a_third_time(tmp_path):
    # SeanLee97/AnglE#89 (commit ef0b987), written blind again (batch blind-cs): AngleDataCollator pads the masks with
    # tokenizer.pad as if ids (pad_token_id 1), RobertaModel attends the padding; the fix pads the ids only
    found = check_bug(tmp_path, "angle_emb_collator_attention_mask_padded_with_pad_token_id", "padding-unmarked")
    lengths = (16, 6)  # <s> + words + </s>, right-padded to 16 with id 1
    assert tuple(found[0]["cell"]) == first((2, 16, 16), lambda b, q, k: q < lengths[b] <= k)
    assert "(60 such cells)" in found[0]["message"] and "pad id (1)" in found[0]["message"]


def _hole_seen_by_none(ids, mask, pad):
    """bad(b, q, k) by a loop: k a token at the pad id inside its row (a real token after it) that the loss trains on,
    q a later real query."""
    def bad(b, q, k):
        inside = ids[b][k] == pad and mask[b][k] == 0 and any(mask[b][j] for j in range(k + 1, len(ids[b])))
        return inside and mask[b][q] == 1 and k < q
    return bad


def test_a_collator_mask_from_ids_whose_pad_is_the_eos_hides_a_trained_eos(tmp_path):
    # InternLM/xtuner#567: attention_mask = input_ids.ne(pad_index), pad == eos == 2, a two-turn sample
    found = check_bug(tmp_path, "xtuner_collate_pad_equals_eos_masks_real_eos", "trained-token-masked")
    ids = [[10, 11, 12, 20, 21, 2, 10, 13, 12, 22, 23, 2], [10, 14, 12, 24, 2] + [2] * 7]
    mask = [[int(t != 2) for t in row] for row in ids]
    assert tuple(found[0]["cell"]) == first((2, 12, 12), _hole_seen_by_none(ids, mask, 2))
    assert "(1 such token)" in found[0]["message"] and "Qwen2ForCausalLM" in found[0]["message"]


def test_a_left_padded_chat_batch_whose_pad_is_the_eos_hides_a_trained_eos(tmp_path):
    # written another way: left padding, an eager softmax, the loss outside the model (pad == eos == 0)
    found = check_bug(tmp_path, "left_padded_chat_pad_is_eos_mask_from_ids", "trained-token-masked", folder=TOKENS)
    ids = [[5, 6, 7, 8, 0, 5, 9, 7, 10, 11, 0], [0] * 6 + [5, 12, 7, 13, 0]]
    mask = [[int(t != 0) for t in row] for row in ids]
    assert tuple(found[0]["cell"]) == first((2, 11, 11), _hole_seen_by_none(ids, mask, 0))


def test_bert_nli_build_batch_pads_attention_mask_with_ones(tmp_path):
    """yg211/bert_nli#3: the attention mask padded with 1s, so BERT's real queries see the [PAD] (id 0) tokens at the
    row's end that the mask calls real; the fix (pad with 0s) is quiet."""
    pytest.importorskip("transformers")  # (its BertModel: the hf extra)
    hit = check_bug(tmp_path, "bert_nli_build_batch_pads_attention_mask_with_ones", "padding-unmarked")[0]
    assert "a token at the model's pad id (0)" in hit["message"]


def test_transformers_collator_double_padding_erases_attention_mask(tmp_path):
    """transformers#8915: padding already padded samples again rebuilt attention_mask as all ones
    (written blind, batch blind-n; caught before any rule was changed for it)."""
    pytest.importorskip("transformers")  # (its BertModel: the hf extra)
    check_bug(tmp_path, "transformers_collator_double_padding_erases_attention_mask", "padding-unmarked")


def test_internvl_collator_default_pad_id_zero(tmp_path):
    """OpenGVLab/InternVL#967: concat_pad_data_collator's default pad_id=0 masks a real id-0 token and attends the real
    pads (written blind, batch blind-s; caught before any rule was changed for it)."""
    check_bug(tmp_path, "internvl_concat_pad_collator_default_pad_id_zero", "trained-token-masked")


def _text_hidden(ids: list[list[int]], mask: list[list[int]], pad: int):
    """bad(b, q, k): a text query (not the pad id) does not see a text key at or before it that the mask calls
    padding (a causal mask keeping the mask's 1s), by a loop over positions."""
    return lambda b, q, k: k <= q and ids[b][q] != pad and ids[b][k] != pad and mask[b][k] == 0


def test_a_mask_from_the_response_only_against_the_pad_id_a_config_of_the_programs_own_states(tmp_path):
    # verl-project/verl#6278 (written blind, batch blind-s): the dense attention_mask padded from the response-only
    # loss_mask; the pad id is stated by the engine's own dataclass config (no tokenizer, no EOS)
    found = check_bug(tmp_path, "verl_fsdp_no_padding_attention_mask_from_loss_mask", "real-tokens-masked")
    ids, mask = [[5, 6, 7, 11, 12], [8, 9, 13, 0, 0]], [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert tuple(found[0]["cell"]) == first((2, 5, 5), _text_hidden(ids, mask, 0))
    assert "EngineConfig" in found[0]["message"]
    # written another way: a reward model's eager softmax, left padding with id 3, the config held by the scoring step
    found = check_bug(tmp_path, "mask_from_response_mask_config_pad_id", "real-tokens-masked", folder=TOKENS)
    ids, mask = [[3, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13]], [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert tuple(found[0]["cell"]) == first((2, 6, 6), _text_hidden(ids, mask, 3))
    assert "BatchConfig" in found[0]["message"]


def test_coreml_sd3_t5_encoder_attention_mask_inverted(tmp_path):
    """apple/ml-stable-diffusion (SD3 T5 encoder): the padding mask's polarity inverted, so real tokens attend the pads
    and the pads are called real (written blind, batch blind-u; caught before any rule was changed for it)."""
    check_bug(tmp_path, "coreml_sd3_t5_encoder_attention_mask_inverted", "padding-unmarked")


def test_diffusers_chroma_t5_encoder_sees_extra_padding_token(tmp_path):
    """huggingface/diffusers#12508: Chroma's "real tokens + one pad" mask, meant for the MMDiT, is also handed to the
    T5 encoder, which attends the first pad (written blind, batch blind-x; caught before any rule was changed for it).
    Row 0 has 7 real tokens: key 7 is its first pad."""
    pytest.importorskip("transformers")
    [hit] = check_bug(tmp_path, "diffusers_chroma_t5_encoder_sees_extra_padding_token", "padding-unmarked")
    assert hit["cell"] == [0, 0, 7]


def test_a_decoders_start_token_at_the_pad_id_is_not_padding(tmp_path):
    """T5 / Marian / Chronos start the decoder from the pad id (`decoder_start_token_id == pad_token_id`): every decoder
    row begins with that one real token. Quiet on a Marian-style model whose dataclass config states it, and on the
    Chronos program written blind (quiet-i), whose decoder cross-attends an encoder and states the start id nowhere."""
    from checkbugs import traced

    quiet = Path(__file__).parent / "data" / "quiet"
    status, found, report = traced(tmp_path, "marian_style_decoder_start_is_pad_batched_generate", False, quiet)
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report
    assert "padding-unmarked" not in report


def test_the_start_token_reading_needs_one_leading_pad_in_every_row_and_a_decoder():
    from types import SimpleNamespace

    from maskcli.checks.tokens import _start_token

    top = SimpleNamespace(config=SimpleNamespace(decoder_start_token_id=3))
    plain = SimpleNamespace(config=SimpleNamespace())
    run = SimpleNamespace(cross=[], calls=[], top=lambda call: None)
    one = np.array([[1, 0, 0], [1, 0, 0]], bool)
    assert _start_token(run, top, one, 3)  # the config says the decoder starts at the pad id
    assert not _start_token(run, top, one, 4)  # another start id: the leading pad id is padding
    assert not _start_token(run, plain, one, 3)  # no statement, no cross-attention: a decoder-only model's padding
    assert not _start_token(run, top, np.array([[1, 0, 0], [1, 1, 0]], bool), 3)  # left padding differs by row
    assert not _start_token(run, top, np.array([[0, 0, 1], [0, 0, 1]], bool), 3)  # at the end: right padding
    call = object()
    crossing = SimpleNamespace(cross=[call], calls=[], top=lambda c: plain if c is call else None)
    assert _start_token(crossing, plain, one, 3)  # the module's calls cross-attend to an encoder: a decoder


def test_a_text_encoder_handed_padded_ids_as_its_first_argument_and_an_all_ones_mask_is_found(tmp_path):
    # huggingface/transformers#25908: SpeechT5's _generate_speech set encoder_attention_mask = ones_like(input_values)
    # over text padded with config.pad_token_id (1): 5 tokens then 4 pads, the embedding's padding_idx the pad id
    pytest.importorskip("transformers")  # (its SpeechT5Config: the hf extra)
    found = check_bug(tmp_path, "speecht5_generate_speech_encoder_mask_ignores_pad_tokens", "padding-unmarked")
    assert tuple(found[0]["cell"]) == first((1, 9, 9), lambda b, q, k: q < 5 and k >= 5)
    assert "all-ones mask" in found[0]["message"]


def test_left_padded_ids_under_the_models_own_name_with_an_all_ones_mask_are_found(tmp_path):
    # written otherwise: left-padded, the pad id a module attribute, SDPA with a bool keep-mask, ids named `text`
    found = check_bug(tmp_path, "left_padded_encoder_ones_mask_pad_attribute", "padding-unmarked", folder=TOKENS)
    pads = (0, 3)
    assert tuple(found[0]["cell"]) == first((2, 5, 5), lambda b, q, k: q >= pads[b] and k < pads[b])


def test_idefics_processor_longest_padding_attention_mask_all_ones(tmp_path):
    """huggingface/transformers#28591 (fixed by #29449): IDEFICS' processor re-pads the tokenizer's padded batch and
    rebuilds attention_mask as all ones, so real tokens attend the padding (written blind, batch blind-aa; caught
    before any rule was changed for it). The fix is quiet."""
    check_bug(tmp_path, "idefics_processor_longest_padding_attention_mask_all_ones", "padding-unmarked")


def test_modelopt_ptq_preview_generate_without_attention_mask(tmp_path):
    # NVIDIA/Model-Optimizer#1673: generate(preview_input_ids) with no mask and pad == eos (its generation_config's):
    # generate infers all ones, the prompt's five leading pads attended
    found = check_bug(tmp_path, "modelopt_ptq_preview_generate_without_attention_mask", "padding-unmarked")
    assert tuple(found[0]["cell"]) == first((1, 8, 8), lambda b, q, k: q >= 5 and k < 5 and k <= q)
    assert "the model's pad id (2)" in found[0]["message"]


def test_a_pad_that_is_the_eos_leading_each_padded_row_twice_or_more_is_padding(tmp_path):
    """Written otherwise: a bidirectional sentence encoder whose config's pad id is its EOS id, each text ending in
    that EOS, rows left-padded by 0, 4 and 2 with it and an all-ones mask. The leading run is padding, the closing EOS
    text. Its first cell against a double loop: a real query that sees a leading pad."""
    found = check_bug(tmp_path, "pad_is_eos_left_padded_encoder_ones_mask", "padding-unmarked", folder=TOKENS)
    pads = (0, 4, 2)
    assert tuple(found[0]["cell"]) == first((3, 7, 7), lambda b, q, k: q >= pads[b] and k < pads[b])


def test_a_pad_that_is_the_eos_is_read_only_as_a_leading_run_two_long():
    from maskcli.checks.tokens import _leading_runs

    ids = np.array([[1, 1, 5, 6, 1], [7, 8, 9, 4, 1], [1, 1, 1, 5, 1]])
    lead = _leading_runs(ids == 1, None)
    assert lead.sum(axis=1).tolist() == [2, 0, 3]  # (the closing EOS of each row is text)
    assert _leading_runs(np.array([[1, 5, 6], [7, 8, 1]]) == 1, None) is None  # one leading EOS: a BOS, say
    assert _leading_runs(ids == 1, "right") is None


def test_a_real_token_that_sees_no_key_under_a_finite_fill_sees_its_target(tmp_path):
    """swiss-ai/Megatron-LM#40 (written blind, batch blind-ao): the BOS xdoc mask hides every BOS row; its scores are
    filled with -10000, so softmax weighs every key alike there, the next token among them, and the loss counts it.
    The rows found against a double loop over the program's BOS positions."""
    found = check_bug(tmp_path, "swiss_megatron_bos_xdoc_mask_hides_bos_and_own_doc_start", "sees-its-target")
    assert tuple(found[0]["cell"]) == (0, 0, 1)
    assert "2 such queries" in found[0]["message"]  # (the two BOS rows: 0 and 6)


def test_a_document_mask_strict_on_the_diagonal_blinds_each_first_token_to_a_uniform_row(tmp_path):
    """Written otherwise: a nanoGPT-style model on EOS-delimited packed documents whose hand-built mask takes keys
    strictly before the query; each document's first token sees nothing, filled with -1e9: uniform weights over the
    whole row. Its first flagged row against a double loop over the documents."""
    found = check_bug(tmp_path, "strict_document_mask_first_token_blind", "sees-its-target", folder=UNIFORM)
    rows = [[5, 6, 7, 0, 8, 9, 10, 11, 0, 12, 13, 0], [14, 15, 0, 16, 17, 18, 0, 19, 20, 21, 22, 0]]
    starts = {(b, q) for b, row in enumerate(rows) for q in range(11) if q == 0 or row[q - 1] == 0}
    assert tuple(found[0]["cell"]) == first((2, 11, 12), lambda b, q, k: (b, q) in starts and k == q + 1)
    assert f"{len(starts)} such queries" in found[0]["message"]


def test_the_same_left_padding_bug_written_by_another_hand(tmp_path):
    """NVIDIA-NeMo/Automodel#3704 written blind a second time (batch blind-ao; blind-d's is the same fix, which the
    writer's exclusion list missed): caught as blind-d's is, and its fix, whose attention_mask states the left padding,
    gets no sees-its-target from the padding rows."""
    check_bug(tmp_path, "automodel_sft_left_padded_attention_mask_all_ones", "padding-unmarked")


def test_an_all_zero_attention_mask_over_real_ids_is_a_real_query_blind(tmp_path):
    """coreweave/kubernetes-cloud#146 (written blind, batch blind-ao): the finetuner's mask is torch.zeros, so every
    token of a GPT-NeoX training batch sees no key; the ids say they are real (none is the pad id)."""
    check_bug(tmp_path, "coreweave_finetuner_dataset_attention_mask_all_zeros", "real-query-blind")


def test_a_hand_made_padding_mask_over_filler_ids_is_no_masked_text():
    from maskcli.checks.tokens import _filler
    # no id at the pad id; the mask's 0s one run at the end of a row, the longest row unpadded: padding, not text
    at_pad = np.zeros((2, 10), bool)
    given = np.ones((2, 10), int)
    given[1, 7:] = 0
    assert _filler(at_pad, given, None)
    every = given.copy()
    every[0, 8:] = 0  # every row has 0s (a response masked in each row: DPO#1): not a padded batch's shape
    assert not _filler(at_pad, every, None)
    inside = given.copy()
    inside[0, 3] = 0  # a 0 inside a row: not padding
    assert not _filler(at_pad, inside, None)
    stated = at_pad.copy()
    stated[1, 9] = True  # the ids state padding with the pad id somewhere: they speak, the mask is judged against them
    assert not _filler(stated, given, None)


def test_a_compound_word_lm_whose_config_picks_non_causal_linear_attention_is_found(tmp_path):
    # s-omranpour/MIDI-Transformer#1 (written blind, batch blind-ez): self_attention_type "linear" built a FullMask and
    # fast-transformers' LinearAttention, einsum("nshd,nshm->nhmd", φ(K), V) summed over every key, while each field's
    # head is trained on the next compound token's field (labels = seq[:, 1:], X = seq[:, :-1])
    found = check_bug(tmp_path, "midi_transformer_cp_encoder_linear_attention_not_causal", "sees-its-target")
    assert tuple(found[0]["cell"]) == first((2, 16, 16), lambda b, q, k: k == q + 1)  # unpadded, every target counted
    assert "input ids of CPTransformer shifted by one; 30 such queries" in found[0]["message"]  # 15 a row
    assert "linear attention sums φ(k) vᵀ over every key" in found[0]["message"]


def test_a_positive_feature_linear_lm_sequence_first_summed_over_every_key_is_found(tmp_path):
    found = check_bug(tmp_path, "positive_feature_lm_seq_first_kv_summed_over_every_key", "sees-its-target",
                      folder=TOKENS)
    lengths = (9, 6, 8)  # sentences, right-padded with 0 (the loss's ignore_index); data = [:-1], targets = [1:]
    counted = [(b, q) for b in range(3) for q in range(7) if q + 1 < lengths[b]]  # q's target is word q + 1
    assert tuple(found[0]["cell"]) == first((3, 8, 8), lambda b, q, k: k == q + 1 and (b, q) in counted)
    assert f"input ids of WordLM shifted by one; {len(counted)} such queries" in found[0]["message"]


def test_a_bidirectional_linear_attention_encoder_on_a_masked_token_loss_is_quiet(tmp_path):
    from checkbugs import traced

    status, found, report = traced(tmp_path, "linear_attention_mlm_encoder_bidirectional", False, TOKENS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "padding (--lengths 10,7 --pad left)" in report  # the linear attention read, its zeroed keys unseen


def test_a_linear_attentions_key_summary_is_read_from_its_equation_alone():
    from maskcli.trace.linearattn import _summary

    assert _summary("nshd,nshm->nhmd", (4, 4)) == (1, (0, 2))  # fast-transformers: summed over s, kept n and h
    assert _summary("...nd,...ne->...de", (4, 4)) is not None  # lucidrains', leading axes unnamed
    assert _summary("bhqd,bhkd->bhqk", (4, 4)) is None  # q @ kᵀ: summed over the features
    assert _summary("bhqk,bhkd->bhqd", (4, 4)) is None  # the weights @ v: the weights' own axis is no feature
    assert _summary("nhld,nhlm->nhldm", (4, 4)) is None  # the causal form's outer products (then a prefix sum)


def _loaded(path: Path, name: str):
    """The program run as a module (its buggy path: no --fixed in pytest's argv), for the data it builds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moonbeam_packed_block_diagonal_mask_without_causal_under_a_shifted_labels_loss(tmp_path):
    """guozixunnicolas/Moonbeam-MIDI-Foundation-Model a7d3f9f (written blind, batch blind-fl): _update_causal_mask turns
    the per-note piece numbers of a packed chunk into a same-piece mask and never adds causality; the model's own loss
    takes its `labels` one position on (they are the notes' fields remapped to the heads' vocabulary, not the ids)."""
    name = "moonbeam_packed_block_diagonal_mask_missing_causal"
    found = check_bug(tmp_path, name, "sees-its-target")
    pieces = _loaded(Path(__file__).parent / "data" / "bugs" / f"{name}.py", "moonbeam_a7d3f9f").batch["attention_mask"]
    pieces = pieces.tolist()
    # upstream meaning: a note may attend the notes before it in its own piece; query q's answer is note q + 1
    leaks = [(b, q) for b in range(2) for q in range(63) if pieces[b][q] == pieces[b][q + 1]]
    assert tuple(found[0]["cell"]) == first((2, 64, 64), lambda b, q, k: k == q + 1 and pieces[b][q] == pieces[b][k])
    assert f"the `labels` of LlamaForCausalLM shifted by one; {len(leaks)} such queries" in found[0]["message"]


def test_a_unit_lm_packed_by_segments_whose_labels_are_not_its_ids_without_causal(tmp_path):
    """The same bug written another way: an eager softmax keeps each packed utterance to itself (segment_ids in a batch
    dict, right padding) with no causal part, and the forward's loss shifts labels that are the raw units, not the ids."""
    name = "unit_lm_packed_segments_labels_not_ids_no_causal"
    found = check_bug(tmp_path, name, "sees-its-target", folder=TOKENS)
    program = _loaded(TOKENS / f"{name}.py", "unit_lm")
    g = torch.Generator().manual_seed(1)  # (the program's utterances, packed by its own collator)
    utterances = [torch.randint(0, 20, (n,), generator=g).tolist() for n in (5, 7, 4, 6, 8, 3)]
    batch = program.pack(utterances, 20, program.CONFIG)
    seg, labels = batch["segment_ids"].tolist(), batch["labels"].tolist()
    counted = [(b, q) for b in range(2) for q in range(19) if seg[b][q] == seg[b][q + 1] > 0 and labels[b][q + 1] != -100]
    assert tuple(found[0]["cell"]) == first((2, 20, 20), lambda b, q, k: k == q + 1 and (b, q) in counted)
    assert f"the `labels` of UnitLMForCausalLM shifted by one; {len(counted)} such queries" in found[0]["message"]


def test_a_masked_unit_predictor_on_unshifted_labels_attending_both_ways_is_quiet(tmp_path):
    from checkbugs import traced

    status, found, report = traced(tmp_path, "unit_encoder_masked_prediction_labels_both_ways", False, TOKENS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_labels_are_read_as_the_targets_one_position_on_and_never_unshifted():
    from maskcli.trace.losses import _labels_shifted

    labels = np.array([[[0, 5, 6], [0, 7, 1], [0, 2, 2], [0, 9, 3]]])  # (B, L, F): one label vector a position
    axis, predicts = _labels_shifted(labels[:, 1:].reshape(-1), labels, -100)
    assert axis == 1 and predicts.tolist() == [[True, True, True, False]]
    assert _labels_shifted(labels.reshape(-1), labels, -100) is None  # the labels at their own positions: no shift
    padded = np.concatenate([labels[:, 1:], np.full((1, 1, 3), -100)], axis=1)  # ForCausalLMLoss pads with ignore
    assert _labels_shifted(padded.reshape(-1), labels, -100)[1].tolist() == [[True, True, True, False]]


def test_axolotl_pretraining_labels_copy_the_padded_input_ids(tmp_path):
    """axolotl-ai-cloud/axolotl#2227 (commit 3915abee4; written blind, round 51, caught before any rule was changed for
    it): encode_pretraining's labels are the padded input ids, so the pad after each document is a target the loss
    trains on while the attention_mask hides it."""
    pytest.importorskip("transformers")  # (its LlamaForCausalLM: the hf extra)
    [hit, *_] = check_bug(tmp_path, "axolotl_encode_pretraining_labels_copy_padded_input_ids", "trained-token-masked")
    assert "a token the program's loss trains on" in hit["message"]
    assert "attention_mask of LlamaForCausalLM marks padding inside the row" in hit["message"]


def _bidirectional_lm(forward_mask, backward_mask) -> list:
    """Written otherwise (AllenNLP's bidirectional LM transformer, quiet_blind round 60): two streams over the same ids,
    the forward one trained on the next token, the backward one on the previous token (two cross-entropy losses), each
    masked by its own (L, L) keep mask. The codes and cells found."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    embed, proj, head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 24), torch.nn.Linear(8, 20)
    ids = torch.tensor([[3, 5, 9, 2, 14, 7], [4, 11, 6, 8, 2, 13]])

    def stream(x, keep):
        q, k, v = proj(x).chunk(3, dim=-1)
        return ((q @ k.transpose(1, 2)).masked_fill(~keep, float("-inf")).softmax(-1) @ v)

    class BiLM(torch.nn.Module):
        def forward(self, tokens):
            x = embed(tokens)
            fwd, bwd = stream(x, forward_mask), stream(x, backward_mask)
            loss = F.cross_entropy(head(fwd[:, :-1]).transpose(1, 2), tokens[:, 1:])
            return loss + F.cross_entropy(head(bwd[:, 1:]).transpose(1, 2), tokens[:, :-1])

    with maskcli.trace() as t, torch.no_grad():
        BiLM()(ids)
    return [(f.code, tuple(f.cell)) for group in t.groups() for f in group.findings if f.code == "sees-its-target"]


def test_a_bidirectional_lm_whose_backward_stream_sees_the_next_token_is_quiet_and_one_that_sees_both_is_not():
    """The backward stream (query i sees keys i and after) sees the token after it, the forward stream's target, but
    never its own (the token before it): quiet. With both streams unmasked every query sees both of its targets: the
    first is query 1 (query 0 has no previous token), key 2."""
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    assert _bidirectional_lm(tril, tril.T) == []
    full = torch.ones(6, 6, dtype=torch.bool)
    found = _bidirectional_lm(full, full)
    assert found and all(cell == (0, 1, 2) for _, cell in found)


def test_a_later_packed_examples_bos_masked_on_purpose_is_not_text_hidden(tmp_path):
    """axolotl#131's fix (blind-kp: real-tokens-masked on it before): a constant-length packing dataset marks 0 the BOS
    of each example after a row's first, and the loss trains on the whole row. Written another way: a dataclass config
    states bos_token_id, a hand-written causal decoder over SDPA. Quiet: a BOS masked inside a row is no text hidden,
    nor a trained token hidden."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "packed_examples_later_bos_masked_quiet", False, TOKENS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_at_bos_is_the_stated_bos_id_apart_from_the_pad_id():
    from types import SimpleNamespace

    from maskcli.checks.padruns import at_bos

    ids = np.array([[1, 5, 1, 0], [7, 1, 2, 0]])
    top = SimpleNamespace(arguments={}, config=SimpleNamespace(bos_token_id=1))
    assert (at_bos(ids, top, 0) == (ids == 1)).all()
    assert not at_bos(ids, top, 1).any() and not at_bos(ids, top, 0, (2, 3)).any() and not at_bos(None, top, 0).any()
    assert (at_bos(ids, SimpleNamespace(arguments={"tokenizer_bos_id": 7}, config=None), 0) == (ids == 7)).all()


def test_the_last_left_pads_row_opened_to_every_key_is_no_real_query_seeing_its_target(tmp_path):
    """unsloth#4100's fix (blind-kp: sees-its-target on it before): on a left-padded batch the last pad's logits
    predict the first real token (the shifted labels count it) and its row, with no key, is opened to every key against
    NaN. Written another way: a hand-written LM, labels -100 on the pads, `keep | ~keep.any(-1)`. Quiet: that query
    is padding."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "left_padded_lm_pad_rows_unmasked_quiet", False, TOKENS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_text_padded_with_its_own_stop_token_is_padding_placed_by_position(tmp_path):
    """IndexTTS's fix (tests/data/blind, written blind, batch blind-lv) written another way (tests/data/tokens): each
    row's text is padded on the right with the stop-text id itself, the mask 0 over those fillers and 1 over the real
    stop token after the text, then the speech codes. The masked tokens are all of one id inside the row, yet a token of
    that id in the row is kept: no mask built from the ids (which would hide every stop token, OpenRLHF's EOS), but
    padding placed by each row's length. Said as real-tokens-masked before; quiet now."""
    status, found, report = traced(tmp_path, "tts_text_padded_with_its_stop_token_then_speech_codes", False, TOKENS)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert '1,1,1,0,0,0,1,1,1' in report, report  # (the padded row's mask was read)


def test_rlinf_agent_loop_tool_output_zeroed_in_the_actors_attention_mask(tmp_path):
    """RLinf/RLinf 779c3188b (written blind, batch blind-ly; caught before any rule was changed for it): the tool agent's
    batch used the loss's `response_mask` (0 on tool-output tokens) as the response half of the attention mask, so the
    training model re-scored each later turn without seeing the tool output before it. The fix masks only padding."""
    found = check_bug(tmp_path, "rlinf_agent_loop_tool_response_zeroed_in_actor_attention_mask", "real-tokens-masked")
    assert "38 tokens it masks are text, of 14 different ids" in " ".join(found[0]["message"].split())


def test_a_text_whose_own_stop_token_is_masked_and_a_filler_copy_kept(tmp_path):
    """IndexTTS d80d49e's slip written another way (tests/data/tokens, --ones-at-ends): the mask's ones put at the padded
    text's ends (`F.pad(text_masks, (1, 1), value=1)`), so the row's own stop token right after its text is masked and
    the last filler copy of it kept. The masked run follows the text, a kept copy after it: the terminator is hidden
    (real-tokens-masked, its guess the ones padded onto the ends); the run after a kept stop token is the fix (quiet)."""
    status, found, report = traced(tmp_path, "tts_text_padded_with_its_stop_token_then_speech_codes", False, TOKENS,
                                   ("--ones-at-ends",))
    said = [f for f in found if f["code"] == "real-tokens-masked"]
    assert status == 1 and said and tuple(said[0]["cell"]) == (1, 2, 2), report
    assert "the mask's ones padded onto the row's ends" in " ".join(said[0]["message"].split())


def test_moss_collate_mask_cast_from_the_padded_ids(tmp_path):
    """OpenMOSS/MOSS#165 (written blind, batch blind-ms; caught before any rule changed for it): collate_fn built the
    batch mask by padding the input ids and casting them to bool, so the pad token stayed attended and every real token
    of id 0 was masked, though the loss trains on it. The fix pads each sample's own all-ones mask with 0."""
    hit = check_bug(tmp_path, "moss_sft_collate_mask_from_input_ids", "trained-token-masked")[0]
    assert "a token the program's loss trains on" in " ".join(hit["message"].split())


def test_avex_collater_mask_true_on_the_audio_handed_to_beats(tmp_path):
    """earthspecies/avex 2006604 (written blind, batch blind-or; caught before any rule changed for it): the collater's
    `pad_or_window` returned True on the real audio, and BEATs reads True as padding; the fix inverts it. Row 0 is a
    0.45 s clip zero-padded to 1 s at 16 kHz, so its padding_mask calls its (1 - 0.45) * 16000 zero samples real."""
    hit = check_bug(tmp_path, "avex_collater_pad_or_window_mask_true_on_audio_beats", "padding-inverted")[0]
    zeros = round((1 - 0.45) * 16000)
    assert f"(batch row 0: {zeros} zero positions called real)" in " ".join(hit["message"].split())


def test_pytorch_transformers_run_squad_segment_ids_fed_as_attention_mask(tmp_path):
    """huggingface/transformers#800 (written blind, batch blind-pf; caught before any rule changed for it): run_squad's
    TensorDataset held (input_ids, input_mask, segment_ids, ...) and train() / evaluate() read batch[1] as
    token_type_ids and batch[2] as attention_mask, so BERT attended through its segment ids: [CLS], the question and its
    [SEP] (segment 0) hidden from every token. Key 0 is [CLS], no pad. The fix reads them the right way round."""
    hit = check_bug(tmp_path, "pytorch_transformers_run_squad_segment_ids_fed_as_attention_mask", "real-tokens-masked")[0]
    assert tuple(hit["cell"]) == (0, 0, 0)
    assert "marks padding, but its id is not the model's pad id (0)" in " ".join(hit["message"].split())


SEQ2SEQ = Path(__file__).parent / "data" / "seq2seq"


def test_paddlenlp_pegasus_decoder_padding_mask_replaces_its_causal_mask(tmp_path):
    """PaddlePaddle/PaddleNLP#4638 (116114a1; written blind, blind-qt, caught after tuning): #4616 turned a 2-D
    decoder_attention_mask into an additive padding mask, and PegasusDecoder built its causal mask only where none was
    handed, so a training step given the targets' mask ran a decoder that sees later targets. The loss trains on
    `labels`, the decoder inputs one position on: decoder query 0 sees key 1, its own answer."""
    [hit] = check_bug(tmp_path, "paddlenlp_pegasus_decoder_padding_mask_replaces_causal", "sees-its-target",
                      Path(__file__).parent / "data" / "blind")
    assert tuple(hit["cell"]) == (0, 0, 1) and "`decoder_input_ids` of PegasusForConditionalGeneration" in hit["message"]


def test_a_seq2seq_whose_decoder_is_handed_no_causal_mask(tmp_path):
    """Written another way: nn.Transformer with source and target padded to one length (the encoder's and the
    decoder's self-attention of one shape), `tgt_mask` never built; labels are the decoder inputs one on. Only the
    decoder's self-attention is read: the encoder attends both ways as it should. --fixed is quiet."""
    [hit] = check_bug(tmp_path, "nn_transformer_seq2seq_tgt_mask_forgotten", "sees-its-target", SEQ2SEQ)
    assert tuple(hit["cell"]) == (0, 0, 1) and "`decoder_input_ids` of Seq2Seq shifted by one; 8 such" in hit["message"], hit


def test_a_seq2seq_cross_attention_over_a_source_of_the_targets_length_is_not_its_decoder(tmp_path):
    """The fixed model with its cross-attention handed no source padding (a mask of its own, so not one call group with
    the encoder's): a square call over as many keys as decoder inputs, inside the decoder, whose keys are the source's
    (a cross-attention: its query 0 sees source key 1, which is no target). No sees-its-target."""
    text = (SEQ2SEQ / "nn_transformer_seq2seq_tgt_mask_forgotten.py").read_text()
    alone = text.replace("memory_key_padding_mask=input_ids == PAD)", "memory_key_padding_mask=None)")
    assert alone != text
    (tmp_path / "cross.py").write_text(alone)
    status, found, report = traced(tmp_path, "cross", True, tmp_path)
    assert "sees-its-target" not in {f["code"] for f in found}, report


def test_unsloth_zoo_vision_collator_token_type_ids_left_in_the_prompt_layout(tmp_path):
    """unslothai/unsloth-zoo#342 (c8b204f9; written blind, blind-rn, caught before any rule changed for it): the
    prompt + completion collator built its output from the prompt's fields, so `token_type_ids` kept the prompt's
    left-padded layout while the ids were moved: on a padded row Gemma 3's two-way image block landed on text, and an
    answer token's query saw the answer token after it. The fix joins and moves the token types with the ids."""
    [hit] = check_bug(tmp_path, "unsloth_zoo_vision_collator_prompt_completion_token_type_ids_left_in_prompt_layout",
                      "sees-its-target")
    assert tuple(hit["cell"]) == (1, 8, 9) and "query 8 sees key 9" in hit["message"], hit


def test_trl_grpo_paged_generation_prompts_padded_again_on_the_right(tmp_path):
    """huggingface/trl#3722 (5a2b04a69; written blind, blind-rq, caught before any rule changed for it): with
    `use_transformers_paged`, GRPO padded the prompts again on the right while `prompt_mask` kept the tokenizer's left
    padding: each shorter row's first prompt tokens were hidden and its pads attended. The fix pads on the left."""
    hits = check_bug(tmp_path, "trl_grpo_paged_generation_prompts_repadded_right", "real-tokens-masked")
    assert "which the attention_mask of LlamaForCausalLM marks padding, but its id is not the model's pad id (0)" \
        in hits[0]["message"], hits


def test_dummy_batch_whose_positions_count_from_the_mask_is_padding_not_masked_text(tmp_path):
    """quiet-r130a (written blind): onnxruntime's GPT-2 helper draws random ids, pads a random run at each row's start
    and counts position_ids from the mask; real-tokens-masked called the random ids under the 0s text. Written another
    way (tests/data/tokens): a hand-written RoPE decoder's benchmark batch, the pad id three times in a row among one
    row's text. The positions say the 0s are padding: quiet. `--real-batch`: prompts left-padded with the pad id under
    a response mask, positions from that mask too: the ids' own padding says the prompts are text (still said)."""
    name = "dummy_batch_random_ids_left_padding_positions_from_mask"
    status, found, report = traced(tmp_path, name, False, TOKENS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    status, found, report = traced(tmp_path, name, False, TOKENS, ("--real-batch",))
    said = [f for f in found if f["code"] == "real-tokens-masked"]
    assert status == 1 and said and "8 tokens it masks are text, of 8 different ids" in " ".join(said[0]["message"].split())


def test_positioned_padding_against_a_loop_over_rows():
    """padruns.positioned_padding against a loop: a row's 0s one run at its start, its positions on the 1s 0, 1, ...,
    and no two pad ids in a row that pad (masked, or at an edge)."""
    from types import SimpleNamespace

    from maskcli.checks.padruns import positioned_padding

    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, length = rng.integers(1, 4), rng.integers(2, 7)
        given = (np.arange(length)[None, :] >= rng.integers(0, length + 1, (rows, 1))).astype(np.int64)
        if rng.random() < 0.3:
            given[rng.integers(rows), rng.integers(length)] ^= 1
        positions = np.where(given == 1, np.cumsum(given, axis=1) - 1, rng.integers(0, 2))
        if rng.random() < 0.3:
            positions = positions + rng.integers(0, 2, positions.shape)
        ids = rng.integers(0, 3, (rows, length))
        got = positioned_padding(SimpleNamespace(arguments={"position_ids": positions}), given, ids == 0)
        padding_pairs = False
        for b in range(rows):
            for k in range(length - 1):
                pads = [ids[b, j] == 0 and (given[b, j] == 0 or all(ids[b, :j + 1] == 0) or all(ids[b, j:] == 0))
                        for j in (k, k + 1)]
                padding_pairs |= all(pads)
        for b in range(rows):
            ones = [j for j in range(length) if given[b, j] == 1]
            zeros = [j for j in range(length) if given[b, j] == 0]
            want = bool(zeros) and zeros == list(range(len(zeros))) \
                and [positions[b, j] for j in ones] == list(range(len(ones))) and not padding_pairs
            assert got[b] == want, (given, positions, ids)


def test_tokens_sampled_past_a_rows_end_token_and_masked_are_no_text(tmp_path):
    """keras-team/keras-hub#1029 (written blind, blind-vm; its fix was told real-tokens-masked) written another way: a
    static-shape sampling loop keeps sampling rows that ended, and the scoring mask is cut after each row's end token
    (the config's eos_token_id), the tokens past it masked on purpose: quiet. `--over-batch`: the exclusive cumsum runs
    over the flattened batch, so the row after the one that ended loses its sampled text: said, at that row."""
    name = "generated_rows_masked_past_their_end_token_then_scored"
    status, found, report = traced(tmp_path, name, False, TOKENS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    status, found, report = traced(tmp_path, name, False, TOKENS, ("--over-batch",))
    said = [f for f in found if f["code"] == "real-tokens-masked"]
    assert status == 1 and said and " ".join(said[0]["message"].split()).startswith("batch row 2:"), report


def test_past_the_end_against_a_loop_over_rows():
    """padruns.past_the_end against a loop: a row's 0s to its end right after a kept token at the stated EOS id."""
    from types import SimpleNamespace

    from maskcli.checks.padruns import past_the_end

    rng = np.random.default_rng(1)
    top = SimpleNamespace(arguments={}, config=SimpleNamespace(eos_token_id=2))
    listed = SimpleNamespace(arguments={}, config=SimpleNamespace(eos_token_id=[2, 3]))  # (Llama 3's configs: a list;
    # every id of it ends a row; an internal error in benchmarks/false_alarms.py before)
    for _ in range(300):
        rows, length = rng.integers(1, 4), rng.integers(2, 8)
        ids = rng.integers(0, 4, (rows, length))
        given = (np.arange(length)[None, :] < rng.integers(0, length + 1, (rows, 1))).astype(np.int64)
        if rng.random() < 0.3:
            given[rng.integers(rows), rng.integers(length)] ^= 1
        got = past_the_end(top, ids, given)
        for b in range(rows):
            kept = [j for j in range(length) if given[b, j] == 1]
            last = kept[-1] if kept else None
            want = [last is not None and j > last and ids[b, last] == 2 for j in range(length)]
            assert got[b].tolist() == want, (ids, given)
            want = [last is not None and j > last and ids[b, last] in (2, 3) for j in range(length)]
            assert past_the_end(listed, ids, given)[b].tolist() == want, (ids, given)


def test_keras_nlp_gpt2_output_mask_cumsum_taken_over_the_batch(tmp_path):
    """keras-team/keras-hub#1029 (then keras-nlp; written blind, blind-vm): generate_step built the output padding mask
    with an exclusive cumsum of the end locations and no axis, so the sum ran across the batch: row 1 ended at column
    7, and the rows after it lost their tokens from there (their end never came). The reference: the first row
    after the one that ended, row 2, is told. The fix's mask, cut after each row's own end token, is quiet."""
    hit = check_bug(tmp_path, "keras_nlp_gpt2_generate_output_padding_mask_cumsum_over_batch", "real-tokens-masked")[0]
    assert " ".join(hit["message"].split()).startswith("batch row 2:"), hit


def test_xlm_core_masked_diffusion_collator_attends_the_padded_tail(tmp_path):
    """dhruvdcoder/xlm-core#47, fixed by #48 (written blind, blind-xb; caught before tuning, its fix flagged then):
    with `loss_on_padding` the collator gave the whole right-padded row attention_mask 1, so the encoder attended the
    pad-id tail. The fix keeps `prefix + BOS + block_size` slots real, pads among them (the block the model learns to
    fill), and marks the rest 0: the mask's padding lies inside the pad run, found on its side, so the fix is quiet."""
    found = check_bug(tmp_path, "xlm_core_mlm_seq2seq_suffix_tail_attended", "padding-unmarked")
    assert "a token at the model's pad id (0) in the run at the row's edge" in " ".join(found[0]["message"].split())
