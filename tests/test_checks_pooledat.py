"""checks/pooledat.py (fed by trace/poolrows.py): a batch row of a model's output pooled at a position its attention_mask
marks padding, on a reproduction of a published bug (Echo's last-token pool of a left-padded batch at
`attention_mask.sum(1) - 1`) and on the same bug written otherwise (a right-padded batch pooled at `[:, -1]`, the fix
a `gather`), both fixes quiet; a language model's logits read so (ms-swift's reranker at `[:, -1]` of a right-padded
batch; a left-padded judge gathered at `attention_mask.sum(-1) - 1`); a model call inside the outermost one pooled so
(sentence-transformers' CLS pooling at `token_embeddings[:, 0]` of a left-padded batch, inside its Sequential; a DPR
bi-encoder's two BERT towers pooled at `[:, 0, :]` inside its forward), and correct poolings inside a pipeline quiet; the
positions trace reads of an index against what torch's indexing returns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from checkbugs import BUGS, check_bug, first, traced
from maskcli.checks.context import Run, Top
from maskcli.checks.pooledat import padding_pooled
from maskcli.trace.poolrows import _gathered, _hidden, _indexed

POOLPAD = Path(__file__).parent / "data" / "pooledat"


def test_echo_last_token_pool_of_a_left_padded_batch_is_flagged_and_its_fix_is_not(tmp_path):
    # xiezijun714-lang/Echo PR #24: DenseRetriever._last_token_pool gathered attention_mask.sum(1) - 1 of a batch its
    # tokenizer padded on the left (padding_side="left"), pooling rows at pad or mid-sequence tokens
    [hit] = check_bug(tmp_path, "echo_bcp_retrieval_server_last_token_pool_left_padding", "pooled-at-padding")[:1]
    assert "batch row 1 (and row 2)" in hit["message"] and "position 6" in hit["message"]
    assert "padded on the left" in hit["message"]


def test_a_right_padded_batch_pooled_at_its_last_column_is_flagged_and_the_gather_fix_is_not(tmp_path):
    [hit] = check_bug(tmp_path, "mistral_embedder_right_padded_batch_pooled_at_last_column", "pooled-at-padding", POOLPAD)[:1]
    assert "batch row 1 (and row 2)" in hit["message"] and "position 7 by [:, -1]" in hit["message"]
    assert "padded on the right" in hit["message"]


def test_ms_swift_reranker_logits_read_at_the_last_column_of_a_right_padded_batch_are_flagged(tmp_path):
    # modelscope/ms-swift#5751: in training Template._pad_sequence padded the generative reranker's pairs on the right,
    # yet generative_reranker_loss reads the yes/no logits at logits[:, -1], a pad position of every shorter pair
    [hit] = check_bug(tmp_path, "ms_swift_generative_reranker_right_padding_last_logit_is_pad", "pooled-at-padding")[:1]
    assert "batch row 0 (and rows 1, 3, 5)" in hit["message"]
    assert "logits are read at position 14 by [:, -1]" in hit["message"]
    assert "padded on the right" in hit["message"]


def test_a_left_padded_judge_logits_gathered_at_a_right_padding_length_are_flagged(tmp_path):
    [hit] = check_bug(tmp_path, "gpt2_pointwise_judge_left_padded_logits_gathered_at_length", "pooled-at-padding",
                      POOLPAD)[:1]
    assert "batch row 1 of GPT2LMHeadModel's logits are read at position 9 by gather(1, ...)" in hit["message"]
    assert "tokens: 13-22, padded on the left" in hit["message"]


def test_an_index_of_one_row_and_one_position_is_read_as_that_cell():
    # the reference: torch's own indexing of one cell, against the row and position read
    x = torch.arange(3 * 5).view(3, 5)
    for i, j in [(0, 0), (2, -1), (1, 3)]:
        rows, positions, how = _indexed((i, j), 3, 5)
        assert x[i, j].item() == x[rows[0], positions[0]].item() and how == "[row, position]"
    assert _indexed((3, 0), 3, 5) is None and _indexed((True, 0), 3, 5) is None


@pytest.mark.parametrize("name, folder, said", [
    # RUCAIBox/RecBole 963ea0f1 (PR #1675; written blind, blind-gs): BERT4Rec.predict gathered each history's output at
    # `item_seq_len`, one past the [MASK] at `item_seq_len - 1`; its forward called as a method (`self.forward`) and
    # handed no attention_mask: its padding is its ids against `nn.Embedding(padding_idx=0)`, which its mask keeps to
    ("recbole_bert4rec_predict_gathers_first_pad_position", BUGS, [
        "batch row 0 (and rows 1, 2) of BERT4Rec's output is pooled at position 4 by gather(1, ...)",
        "its ids `item_seq` padded with the pad id 0 the model states", "the row's length taken as its last position"]),
    ("sasrec_left_padded_histories_gathered_at_length_minus_one", POOLPAD, [
        "batch row 1 of SASRec's output is pooled at position 2", "tokens: 5-7, padded on the left", "length - 1"]),
    # pytorch/rl#3887 (written blind, blind-gy): GPT2RewardModel looked for each row's end by GPT-2's eos id, 50256,
    # whatever the checkpoint's tokenizer pads with, so every end score was read from the last column:
    # `rewards[i, first_pad_ind - 1]`, a value head over GPT2Model's output (a tuple, return_dict=False)
    ("torchrl_gpt2_reward_model_end_scores_gpt2_pad_id_on_other_tokenizer", BUGS, [
        "batch row 0 of GPT2Model's output is read at position 23 by [row, position] of a head computed over it",
        "tokens: 0-10, padded on the right", "the last column"]),
    # TensorAuto/OpenTau#524 (written blind, blind-hs; missed before tuning): a value head read at `[:, -1]` (inference)
    # and `[:, -response_max_length - 1]` (training), pad slots of the right-padded prompt, of a Gemma model handed a 4-D bool mask of the program's own (pad x pad) as the
    # {full, sliding} mapping: its rows' tokens are the queries that see some key
    ("opentau_value_readout_from_padded_prompt_tail", BUGS, [
        "batch row 0 (and row 1) of Gemma3TextModel's output is pooled at position 17 by [:, -5]",  # (training's readout)
        "a padding position of the 4-D attention_mask it was called with (where a query row sees no key)"]),
    ("reward_encoder_4d_pad_mask_read_at_last_column", POOLPAD, [
        "batch row 1 (and row 2) of Encoder's output is pooled at position 6 by [:, -1]", "tokens: 0-2, padded on the right",
        "the 4-D attention_mask it was called with"]),
    ("ppo_critic_left_padded_values_read_per_row_at_length", POOLPAD, [
        "batch row 1 of body's output is read at position 2 by [row, position] of a head",
        "tokens: 5-7, padded on the left"]),
])
def test_outputs_read_at_a_pad_position_by_ids_or_by_a_head_are_flagged_and_their_fixes_are_not(tmp_path, name, folder,
                                                                                                 said):
    [hit] = check_bug(tmp_path, name, "pooled-at-padding", folder)[:1]
    for part in said:
        assert part in hit["message"]


def test_ids_against_a_pad_id_that_is_also_eos_state_no_padding():
    # a model whose pad id is its eos (GPT-2's convention) may pool at a real eos: its ids say nothing of padding
    from maskcli.trace.poolrows import _mask

    class Model(torch.nn.Module):
        def __init__(self, eos):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4, padding_idx=0)
            self.eos_token_id = eos

        def forward(self, input_ids):
            return self.emb(input_ids)

    ids = torch.tensor([[5, 6, 0, 0], [5, 6, 7, 8]])
    assert _mask(Model(eos=0), (ids,), {}) is None
    mask = _mask(Model(eos=2), (ids,), {})
    assert mask.tolist() == (ids != 0).tolist() and "pad id 0" in mask.stated_by
    assert _mask(Model(eos=2), (ids,), {"attention_mask": torch.ones(2, 4)}).tolist() == [[1.0] * 4] * 2


def _left_padded_cls(lengths: list[int]):
    """The first (row, position, position) where CLS pooling (position 0 of every row, the upstream `token_embeddings[:, 0]`)
    reads a pad of a batch padded on the left to the longest row: the reference, a loop over rows and positions."""
    width = max(lengths)
    pad = lambda b, k: k < width - lengths[b]  # noqa: E731 - a left pad of row b
    found = first((len(lengths), 1, width), lambda b, q, k: k == 0 and pad(b, k))
    return None if found is None else [found[0], found[2], found[2]]


def test_sentence_transformers_cls_pooling_of_a_left_padded_batch_inside_its_pipeline_is_flagged(tmp_path):
    # huggingface/sentence-transformers#3767 (fixes #3208): Pooling(pooling_mode="cls") took token_embeddings[:, 0],
    # a [PAD] position of the shorter rows a Llama tokenizer pads on the left; the fix gathers attention_mask.argmax(1).
    # The read is of LlamaModel's output inside the Sequential's call, not of the outermost call's output.
    hits = check_bug(tmp_path, "sentence_transformers_cls_pooling_left_padding_takes_pad_token", "pooled-at-padding")
    queries = ["what is a mask", "padding side left", "cls pooling"]
    assert hits[0]["cell"] == _left_padded_cls([len(t) for t in queries])
    assert "LlamaModel's output is pooled at position 0 by [:, 0]" in hits[0]["message"]
    assert "a first-token (CLS) position" in hits[0]["message"] and "padded on the left" in hits[0]["message"]


def test_a_bi_encoder_s_towers_pooled_at_cls_of_a_left_padded_batch_inside_its_forward_are_flagged(tmp_path):
    hits = check_bug(tmp_path, "dpr_biencoder_left_padded_cls_pooled_inside_forward", "pooled-at-padding", POOLPAD)
    questions = [[12, 40, 7], [33, 5, 18, 61, 9, 22], [70, 3]]  # ([CLS] and [SEP] around each)
    assert hits[0]["cell"] == _left_padded_cls([len(q) + 2 for q in questions])
    assert "batch row 0 (and row 2) of BertModel's output is pooled at position 0" in hits[0]["message"]


def test_correct_poolings_inside_a_pipeline_are_quiet(tmp_path):
    status, found, report = traced(tmp_path, "pipeline_poolings_inside_forward_correct", False, POOLPAD)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def _read(hidden: torch.Tensor, picked: torch.Tensor):
    """(rows, positions) a pooled (B, D) tensor was read at, decoded from a hidden state holding b * 100 + l."""
    codes = picked[:, 0].long().numpy()
    return codes // 100, codes % 100


def test_the_positions_read_match_what_torch_indexing_returns():
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows, length = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        hidden = (torch.arange(rows)[:, None] * 100 + torch.arange(length)[None, :]).float()[..., None].expand(-1, -1, 3)
        positions = torch.from_numpy(rng.integers(-length, length, rows))
        kind = int(rng.integers(3))
        if kind == 0:
            index = (slice(None), int(positions[0]))
            got = _indexed(index, rows, length)
        elif kind == 1:
            index = (torch.from_numpy(rng.permutation(rows)), positions)
            got = _indexed(index, rows, length)
        else:
            index = None
            gathered = (positions % length).view(-1, 1, 1).expand(-1, 1, 3)
            got = _gathered(1, gathered, rows, length)
            picked = torch.gather(hidden, 1, gathered).squeeze(1)
        if index is not None:
            picked = hidden[index]
        want_rows, want_positions = _read(hidden, picked)
        assert got[0].tolist() == want_rows.tolist() and got[1].tolist() == want_positions.tolist()


def test_only_a_row_pooled_at_its_padding_is_said():
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=bool)  # left-padded, full, all padding
    call = type("Call", (), {"index": 0})()
    top = Top("model", first=0, end=1)
    run = Run([call], [top])
    top.pooled = [{"rows": np.arange(3), "positions": np.array([3, 0, 1]), "how": "[rows, positions]", "mask": mask}]
    assert padding_pooled(run) == []  # the last token, a full row's first, a row with no token
    top.pooled[0]["positions"] = np.array([1, 3, 3])
    [(_, finding)] = padding_pooled(run)
    assert finding.cell == (0, 1, 1) and "tokens: 2-3" in finding.message


def test_logits_are_followed_only_where_they_are_the_call_s_own_positions():
    hidden, logits = torch.zeros(2, 5, 8), torch.zeros(2, 5, 11)
    assert _hidden({"last_hidden_state": hidden, "logits": logits}, {})[1] == "last_hidden_state"
    got, what = _hidden({"logits": logits}, {"input_ids": None})
    assert got is logits and what == "logits"  # a causal LM's
    assert _hidden({"logits": logits, "encoder_last_hidden_state": hidden}, {})[0] is None  # a decoder's over a source
    assert _hidden({"logits": logits}, {"decoder_input_ids": torch.zeros(2, 5)})[0] is None
    assert _hidden({"logits": logits}, {"labels": torch.zeros(2, 5)})[0] is None  # its loss over every position
    assert _hidden({"logits": torch.zeros(2, 11)}, {})[0] is None  # a classifier's (B, C): no positions


def test_a_4d_mask_states_its_rows_tokens_as_the_queries_that_see_some_key():
    from maskcli.trace.poolrows import _mask

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return input_ids

    pad = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    keep = pad[:, None, :, None] & pad[:, None, None, :]
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert _mask(Model(), (ids,), {"attention_mask": keep}).tolist() == pad.tolist()
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert _mask(Model(), (ids,), {"attention_mask": additive}).tolist() == pad.tolist()
    # a mapping by layer type (Gemma 3's {full, sliding}): a query that sees a key in either layer kind is a token
    sliding = keep & torch.ones(4, 4, dtype=torch.bool).triu(-1)
    both = _mask(Model(), (ids,), {"attention_mask": {"full_attention": keep, "sliding_attention": sliding}})
    assert both.tolist() == pad.tolist()
    # every query row alike (pads that see the real tokens, HF eager's expanded 2-D mask): the keys it keeps
    assert _mask(Model(), (ids,), {"attention_mask": pad[:, None, None, :].expand(2, 1, 4, 4)}).tolist() == pad.tolist()


def test_a_librarys_own_pooler_reading_its_encoders_output_is_quiet(tmp_path):
    """BertModel's pooler reads `[:, 0]` of its encoder's output, which the model hands the expanded 4-D key mask: on a
    left-padded batch a pad position, but the library's read (its pooler_output unused), not the program's. Only a
    model call of the program's own code is followed inside the outermost one on such a mask (CLIP's port is)."""
    status, found, report = traced(tmp_path, "bert_left_padded_library_pooler_correct", False, POOLPAD)
    assert status == 0 and not [f for f in found if f["code"] == "pooled-at-padding"], report
    assert "matches each text alone: True" in report, report


def test_lm_human_preference_reward_read_at_a_pad_of_truncated_responses(tmp_path):
    """vwxyzjn/lm-human-preference-details 76dfe89 (written blind, batch blind-lw; caught once the last of a model
    output's `hidden_states` and a head's `gain * r + bias` were followed): PPO's rollout truncated each response after
    its stop token and padded the rest, and `get_reward` read `reward[:, -1]` of a head over
    `output.hidden_states[-1]`, a pad slot of every truncated row. The fix moves the pads to the left first."""
    [hit] = check_bug(tmp_path, "lm_human_preference_details_ppo_postprocessed_reward_reads_pad", "pooled-at-padding")
    message = " ".join(hit["message"].split())
    assert "batch row 0 (and rows 5, 6) of reward_model.pretrained_model's output is read at position 35" in message
    assert "padded on the left and right" in message


def test_a_critic_value_from_the_last_hidden_states_read_at_the_last_column(tmp_path):
    """The same slip written another way (tests/data/pooledat): a Llama causal LM asked for its hidden states, a value
    head `head(hidden_states[-1]) * scale + shift`, each episode's value read at `[:, -1]` of a right-padded rollout
    (rows 1 and 2 padded). The fix gathers each row's last real token."""
    [hit] = check_bug(tmp_path, "critic_hidden_states_last_layer_value_read_at_last_column", "pooled-at-padding",
                      POOLPAD)
    assert tuple(hit["cell"]) == (1, 6, 6)  # (row 1's tokens are 0-3: position 6 is its padding)


def test_skyrl_tx_sampler_right_padded_prompts_first_token_read_at_a_pad(tmp_path):
    """NovaSky-AI/SkyRL#747 (written blind, batch blind-lw; caught before any rule was changed for it): the tinker
    sampler right-padded its prompts for a generator written for left padding, so every shorter prompt's first token
    was sampled from a pad slot's output (`[:, -1]`). The fix pads on the left."""
    [hit] = check_bug(tmp_path, "skyrl_tx_tinker_sample_batch_right_padded_prompts", "pooled-at-padding")[:1]
    assert "of Qwen3ForCausalLM's output is pooled at position 31 by [:, -1]" in " ".join(hit["message"].split())


def test_repeng_control_vector_reads_each_rows_last_slot_of_a_right_padded_batch(tmp_path):
    """vgel/repeng#38 (written blind, batch blind-md; missed before: rows handed out one at a time and layers other than
    the last were not followed): batched_get_hiddens iterated each layer's `hidden_states[k]` row by row and kept
    `row[-1, :]`, a pad slot of every sentence shorter than its GPT-2 batch's longest (right-padded, pad = eos). The
    fix reads each row at its last attention_mask position."""
    [hit] = check_bug(tmp_path, "repeng_batched_hiddens_last_slot_is_right_pad", "pooled-at-padding")
    assert "of GPT2LMHeadModel's output is pooled at position 18 by [-1] of each row" in " ".join(hit["message"].split())


def test_a_probe_reading_a_middle_layers_rows_one_at_a_time_at_the_last_slot(tmp_path):
    """The same slip written another way (tests/data/pooledat): a Llama's layer-1 hidden states, each row taken as
    `layer[i]` and read at `[-1]`, of a right-padded batch; row 1's tokens are 0-2, so position 5 is its padding. The
    fix (each row's last real token) is quiet and matches every sentence run alone."""
    [hit] = check_bug(tmp_path, "probe_middle_layer_rows_read_one_at_a_time_at_last_slot", "pooled-at-padding", POOLPAD)
    assert tuple(hit["cell"]) == (1, 5, 5)


def test_sunzeyeah_rlhf_pangu_end_scores_read_at_the_longer_answers_end(tmp_path):
    """sunzeyeah/RLHF#17 (written blind, batch blind-mr; missed before: a (B, 1, L) mask of stacked samples, a (B, 1,
    L, D) output squeezed, and a slice of a row read at its last element were not followed): the pairwise reward model
    read each answer's end score as the last element of `values[i][divergence:max(c_ind, r_ind)]`, a pad slot of the
    shorter answer of a pair. The fix reads each answer at its own last token."""
    [hit] = check_bug(tmp_path, "sunzeyeah_rlhf_pangu_reward_end_scores_at_pair_max_end", "pooled-at-padding")
    assert "read at position 23 by [-1] of a slice of each row of a head" in " ".join(hit["message"].split())


def test_a_pairwise_reward_read_off_a_span_ending_at_the_longer_answer(tmp_path):
    """The same slip written another way (tests/data/pooledat): DeepSpeed-Chat's pairwise loop over a hand-written GPT
    under a value head, its mask BERT's additive -10000, the end score `span[-1]` of `values[i][divergence:end]`; the
    chosen answer of pair 1 (tokens 0-4) read at 7. The fix is quiet and matches each answer run alone."""
    hits = check_bug(tmp_path, "pairwise_reward_truncated_span_last_element_of_the_longer_answer", "pooled-at-padding",
                     POOLPAD)
    assert tuple(hits[0]["cell"]) == (1, 7, 7), hits


def test_gpt_neox_sequence_classification_pools_at_the_pad_count_on_left_padding(tmp_path):
    """huggingface/transformers#24979 (written blind, batch blind-ow; caught before any rule changed for it):
    GPTNeoXForSequenceClassification scored each row at `ne(input_ids, pad).sum(-1) - 1`, the last real token only
    under right padding. Row 2 holds 7 real tokens after 8 pads (columns 8-14), so it is read at 7 - 1 = 6, a pad. The
    fix (the first pad's index - 1, wrapping to the last column) is quiet."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "transformers_gpt_neox_seqcls_left_padded_pools_at_pad_count", "pooled-at-padding")[0]
    pads, real = 8, 7
    assert tuple(hit["cell"]) == (2, real - 1, real - 1) and real - 1 < pads


def test_peft_shadow_classifier_pools_the_last_mask_column_of_a_left_padded_batch(tmp_path):
    """huggingface/peft#3620 (written blind, blind-po, caught before tuning): the detached ShadowPEFT classifier picks
    `attention_mask.sum(1) - 1`, the last real token only under right padding; its left-padded Llama backbone's padded
    rows are pooled at a pad. The fix takes each row's rightmost real position."""
    [hit] = check_bug(tmp_path, "peft_shadow_detached_classifier_left_padded_pools_pad_token", "pooled-at-padding")[:1]
    assert hit["message"].startswith("batch row"), hit


def test_transformers_biogpt_sequence_classification_pooled_at_a_left_pad(tmp_path):
    """huggingface/transformers#46782 (written blind, blind-rv, caught before any rule changed for it): BioGPT's
    sequence-classification head read each row at `ne(input_ids, pad).sum(-1) - 1`, a pad on a left-padded row. The
    fix takes the rightmost real token; both runs keep positions-vs-keys, true of this transformers' BioGPT, which
    numbers a left-padded row's tokens by column when handed no position_ids (the row alone matches only with
    `attention_mask.cumsum(-1) - 1`)."""
    name = "transformers_biogpt_seqcls_left_padded_pools_count_minus_one"
    status, found, report = traced(tmp_path, name, False)
    [hit] = [f for f in found if f["code"] == "pooled-at-padding"]
    assert status == 1 and "batch row 1 of BioGptModel's output is read at position 3" in hit["message"], report
    status, found, report = traced(tmp_path, name, True)
    assert {f["code"] for f in found if f["severity"] == "wrong"} == {"positions-vs-keys"}, report
