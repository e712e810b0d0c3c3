"""checks/arguments.py: the forward call's attention_mask and position_ids, on reproductions of published bugs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import ROWS, caught, check_bug, first, traced
from maskcli.checks.arguments import document_starts

ARGS = Path(__file__).parent / "data" / "args"
BLIND = Path(__file__).parent / "data" / "blind"

BUGS = [
    ("decode_mask_sliced", "padding-ignored"),  # thu-nics/C2C#19: the mask sliced to one column at decode
    ("prefill_mask_ignores_padding", "padding-ignored"),  # ml-explore/mlx-lm#1906: a plain causal mask at prefill
    ("packed_positions_no_document_mask", "documents-leak"),  # huggingface/nanoVLM#204: positions reset, mask causal
    ("packing_position_reset_only", "documents-leak"),  # DeepOpt-com/WrinkleFree-Monorepo#53: the same, RoPE only
    ("chunked_mask_clobbers_documents", "documents-leak"),  # huggingface/transformers#37429: chunks over documents
    # the same bug written blind again (blind-nk, round 81, caught before any rule changed for it): a trimmed Llama 4
    # text model through transformers' own make_flex_block_causal_mask path, flex_attention eager on the CPU
    ("transformers_llama4_flex_chunked_mask_clobbers_packed_document_ids", "documents-leak"),
    # lucidrains/naturalspeech2-pytorch c2cae47 (written blind, blind-np, round 84, caught before any rule changed for
    # it): the phoneme encoder's attention over a right-padded batch was handed no mask at all
    ("naturalspeech2_phoneme_encoder_padded_phonemes_attended", "padding-ignored"),
    # vllm-project/vllm#34127: MiniCPM-V's patch_attention_mask never reaches the ViT's SDPA
    ("vllm_minicpm_idefics2_vit_patch_mask_dropped", "padding-ignored"),
    # huggingface/transformers#35043: BertGeneration builds no mask at all with use_cache: its softmax masks nowhere
    ("bert_generation_use_cache_drops_extended_mask", "padding-ignored"),
    # written blind (batch blind-s), caught before any rule was changed for them:
    # NVIDIA-NeMo/RL#4167: packing boundaries nested in flash_attn_kwargs, which the attention never reads
    ("nemo_rl_packed_nested_flash_attn_kwargs_ignored_by_automodel", "documents-leak"),
    # huggingface/trl#3673: padding-free collator's all-ones mask hides the packed position_ids from FA2
    ("trl_sft_padding_free_packed_all_ones_mask_hides_position_ids", "documents-leak"),
    # written blind (batch blind-ao), caught before any rule was changed for them:
    # hiyouga/LlamaFactory#4224: neat_packing's numbered mask patched into a function Llama never calls
    ("llamafactory_neat_packing_segment_mask_reaches_model_as_plain_causal", "documents-leak"),
    # deepspeedai/DeepSpeed#1466 (blind-ap): the fused softmax drops the padding mask on a triangular (causal) pass
    ("deepspeed_inference_gpt2_softmax_drops_padding_mask_when_triangular", "padding-ignored"),
    # written blind (batches blind-at, blind-au), caught before any rule was changed for them:
    # deepspeedai/DeepSpeed#1912: the input_mask overwritten by a dummy, left pads attended in generation
    ("deepspeed_inference_attention_mask_overwritten_by_dummy", "padding-ignored"),
    # lean-dojo/ReProver#34: the ByT5 premise encoder called with input_ids only, a right-padded batch
    ("reprover_premise_encoder_drops_attention_mask", "padding-ignored"),
    # NVIDIA-NeMo/Automodel#491 (blind-ax): DeepseekV3Model never hands attention_mask to its MLA blocks (TE runs plain
    # causal over a left-padded batch)
    ("automodel_deepseek_v3_mla_te_padding_mask_not_causal", "padding-ignored"),
    # written blind (batch blind-av), caught before any rule was changed for them:
    # gc-os-ai/pyaptamer#178: AptaTrans' nn.TransformerEncoders run with no mask over zero-padded tokens (padding_idx=0)
    ("pyaptamer_aptatrans_encoder_padding_zeros_attended", "padding-ignored"),
    # WhereIsAI/BiLLM#6 (blind-bh, caught before tuning): the bidirectional layers' all-zero mask drops the key padding
    ("billm_bidirectional_layers_unmask_padding", "padding-ignored"),
    # lucidrains/alphafold2 c85682e: the structure module calls the IPA block without the residue mask it was given
    ("alphafold2_structure_module_ipa_ignores_residue_mask", "padding-ignored"),
    # huggingface/transformers#17455 (fixed by #21870): ProphetNet's padding mask `.repeat(num_heads, 1, 1)` (head-major)
    # added to `bmm` scores of queries viewed batch-major (B * H rows): heads take another sample's padding
    ("prophetnet_attention_mask_repeat_mixes_batch_and_heads", "padding-ignored"),
    # written blind (batch blind-cq), caught before any rule was changed for them:
    # agemagician/Ankh#24 (fixed by 50f011f, PR #26): the feature-extraction example keeps only the padded input_ids
    ("ankh_feature_extraction_example_omits_attention_mask", "padding-ignored"),
    # deepchem/deepchem#3597 (fixed by #3667): the MLM branch of _prepare_batch drops the tokenizer's attention_mask
    ("deepchem_chemberta_mlm_prepare_batch_drops_attention_mask", "padding-ignored"),
    # datawhalechina/torch-rechub#244 (blind-cn): HSTULayer masks only the causal triangle before silu(scores), never
    # the left-padded PAD keys (padding_idx=0): silu attention is read as attention (trace/pointwise.py)
    ("torch_rechub_hstu_layer_left_padded_keys_attended", "padding-ignored"),
    # lucidrains/vit-pytorch commit 4c89017 (follow-up to PR #356, blind-ct): ViViT's factorized_self_attention variant
    # takes the frame mask in ViT.forward but never passes it on, so its temporal attention sees the padded frames
    ("vit_pytorch_vivit_factorized_self_attention_drops_frame_mask", "padding-ignored"),
    # huggingface/parler-tts#225 (written blind, batch blind-cw; caught before any rule was changed for it): generate
    # prepares the left-padded prompts' mask from the pad codes and discards it; the decoder runs causal only
    ("parler_tts_causal_lm_generate_discards_prepared_attention_mask", "padding-ignored"),
    # NVIDIA/NeMo#5450 (written blind, batch blind-cw): FastPitch's MultiHeadAttn copied q/k/v batch-major
    # (permute(0, 2, 1, 3).reshape) while its key padding was tiled head-major (`.repeat(n_head, ...)`)
    ("nemo_fastpitch_multiheadattn_batch_major_heads_vs_head_major_mask", "padding-ignored"),
    # agemagician/Ankh#24 again (fixed in commit 50f011f; written blind anew, batch blind-dv, caught before any rule was
    # changed for it): the README's feature extraction keeps only ['input_ids'] of the padded batch
    ("ankh_feature_extraction_readme_drops_attention_mask", "padding-ignored"),
    # massquantity/LibRecommender#359 (written blind, batch blind-ky; caught before any rule was changed for it): its
    # multi_head_attention never handed the Keras MHA the padding and causal mask it built, so items saw pads and later ones
    ("librecommender_transformer_decoder_layer_keras_mha_attention_mask_dropped", "mask-argument-dropped"),
    # ctheodoris/Geneformer 9169bfd (#146; written blind, batch blind-zh, caught before any rule changed for it):
    # EmbExtractor.get_embs pads each batch of cells and calls BertForMaskedLM with input_ids alone
    ("geneformer_emb_extractor_get_embs_no_attention_mask", "padding-ignored"),
    # axolotl-ai-cloud/axolotl 507eee7aa (written blind, batch blind-zp, caught before any rule changed for it): the hybrid
    # mode's global layers on plain sdpa got no mask for a packed row, whose documents only position_ids state
    ("axolotl_gemma4_hybrid_global_layers_sdpa_packed_rows", "documents-leak"),
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_position_ids_zero_padding_is_no_document_but_a_real_query_must_not_see_it(tmp_path):
    # allenai/open-instruct#1900: the chosen padding folded into the first rejected document (its fix: the padding a
    # block of its own, quiet); then a packed row padded with 0s whose second document sees the first
    check_bug(tmp_path, "dpo_packed_cu_seq_lens_fold_chosen_padding", "documents-leak")
    check_bug(tmp_path, "packed_padding_block", "documents-leak", Path(__file__).parent / "data" / "windows")


def test_zero_padding_of_position_ids_against_a_loop():
    from maskcli.checks.arguments import padded_positions

    positions = np.array([[0, 1, 2, 0, 0, 0, 1, 0], [0, 0, 1, 2, 3, 0, 0, 0]])
    want = np.zeros(positions.shape, dtype=bool)
    for b in range(2):
        for i in range(positions.shape[1]):
            nxt = positions[b, i + 1] if i + 1 < positions.shape[1] else 0
            want[b, i] = positions[b, i] == 0 and nxt == 0
    assert np.array_equal(padded_positions(positions), want)


def test_documents_start_where_positions_restart_between_real_tokens():
    """Against a loop over positions: a new document where the position is 0 after a real token; generate's
    left-padded position_ids (cumsum - 1, padding filled with 1) are one document."""
    positions = np.array([[0, 1, 2, 0, 1, 0], [1, 1, 0, 1, 2, 3]])
    real = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    expected = np.zeros_like(positions)
    for b in range(2):
        for i in range(1, 6):
            new = positions[b, i] == 0 and real[b, i] and real[b, i - 1]
            expected[b, i] = expected[b, i - 1] + bool(new)
    assert document_starts(positions, real).tolist() == expected.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]



BACKWARDS = """
import torch, torch.nn.functional as F
def attend(x, position_ids):
    q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
    mask = position_ids[0][:, None] >= position_ids[0][None, :]  # each query sees the keys at its position or before
    return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
print(attend(torch.randn(1, len(POSITIONS), 8), torch.tensor([POSITIONS])).shape)
"""


def test_positions_laid_backwards_pack_no_documents(tmp_path):
    """position_ids 4, 3, 2, 1, 0 go down at every step: one sequence laid backwards, its mask built from them (key j
    seen where its position is at most the query's), not packed documents whose last starts at the 0 (nor 3, 0, 1, 2,
    4, 5, jumping up from 2 to 4 and counting on: one sequence's positions shuffled, quiet-r158a's ConSERT); no
    held-documents-leak, exit 0. The same program with 0, 1, 2, 0, 1 (two packed documents) and the mask built from
    those positions (causal over the whole row) lets query 3 see key 0 of the other document: found, exit 1."""
    import json

    from checkbugs import runner
    from maskcli.commands import app

    script, out = tmp_path / "backwards.py", tmp_path / "b.json"
    for positions, status in (("[4, 3, 2, 1, 0]", 0), ("[0, 1, 2, 3, 4]", 0), ("[3, 0, 1, 2, 4, 5]", 0),
                             ("[0, 1, 2, 0, 1]", 1)):
        script.write_text(BACKWARDS.replace("POSITIONS", positions))
        result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
        codes = [f["code"] for g in json.loads(out.read_text())["groups"] for f in g["findings"] if f["severity"] == "wrong"]
        assert (result.exit_code, codes) == ((0, []) if status == 0 else (1, ["held-documents-leak"])), result.output
    rows = np.array([[4, 3, 2, 1, 0, 0], [0, 1, 2, 0, 1, 2], [0, 1, 2, 1, 0, 0], [3, 0, 1, 2, 4, 5], [2, 3, 0, 1, 2, 9]])
    expected = [[0] * 6, [0, 0, 0, 1, 1, 1], [0] * 6, [0] * 6, [0, 0, 1, 1, 1, 1]]  # (a row that goes down other than to 0,
    # or jumps up into positions that count on, one sentence's positions shuffled (ConSERT), packs nothing)
    assert document_starts(rows, None).tolist() == expected


# a padding mask the wrong way round, however the model call states its padding (checks/real.py)

def test_a_padding_mask_handed_to_sdpa_as_true_is_pad_is_found(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "sdpa_padding_mask_true_is_pad", ("padding-ignored",))
    ids = [[3, 4, 5, 0, 0], [6, 7, 8, 9, 10], [1, 2, 0, 0, 0]]
    # the mask handed to SDPA keeps the padding (True = pad); the attention_mask says 0 = padding
    expected = first((3, 5, 5), lambda b, q, k: ids[b][q] != 0 and ids[b][k] == 0)
    assert tuple(hit["cell"]) == expected and "wrong way round" in hit["message"]


def test_an_mha_key_padding_mask_built_from_lengths_the_other_way_round_is_found(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "mha_lengths_mask_reversed", ("padding-ignored",))
    lengths = [6, 4, 2]  # MHA ignores True, and True was a real frame
    expected = first((3, 6, 6), lambda b, q, k: q < lengths[b] and k >= lengths[b])
    assert tuple(hit["cell"]) == expected and "lengths" in hit["source"]


def test_a_vision_towers_patch_mask_that_never_reaches_its_attention_is_found(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "vit_patch_mask_for_positions_only", ("padding-ignored",))
    # a 4x4 image in a 6x6 batch, 2x2 patches: patches (row, column) with row or column 2 are padding
    real = [[True] * 9, [r < 2 and c < 2 for r in range(3) for c in range(3)]]
    expected = first((2, 9, 9), lambda b, q, k: real[b][q] and not real[b][k])
    assert tuple(hit["cell"]) == expected and hit["source"] == "patch_attention_mask of Tower"


def test_a_mask_made_from_the_ids_the_wrong_way_round_is_found_by_the_embeddings_padding_idx(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "ids_pad_mask_reversed", ("padding-ignored",))
    ids = [[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]]
    expected = first((3, 4, 4), lambda b, q, k: ids[b][q] != 0 and ids[b][k] == 0)
    assert tuple(hit["cell"]) == expected and "pad id 0" in hit["source"]


@pytest.mark.parametrize("name", [
    "label_cross_attention_inverted_padding_mask",  # InseeFrLab/torchTextClassifiers#92: attention_mask == 0 to SDPA
    "paligemma_prefix_lm_unmasks_padding_in_training",  # transformers#35855: the prefix unmasked after the padding
    "llada_mdm_attention_ignores_padding_mask",  # ML-GSAI/LLaDA#89: attn_mask=None though attention_mask was given
])
def test_blind_reproductions_of_a_stated_padding_ignored_are_flagged(tmp_path, name):
    """Written blind (each caught before any rule was tuned for the blind split)."""
    check_bug(tmp_path, name, "padding-ignored")


def test_bionemo_llama3_te_bshd_mask_lt_minus_one_never_masks(tmp_path):
    """NVIDIA/bionemo-framework 2198daf (written blind, batch blind-df; caught before any rule was changed for it):
    the Llama3 recipe turns the HF 0/1 mask into TE's boolean mask with `mask[:, None, None, :] < -1`, False
    everywhere, so a left-padded batch's padding is never masked. The first cell is a double loop's (a real query, a
    padded key it sees causally); the fix (`~mask.bool()`) is quiet."""
    [hit] = check_bug(tmp_path, "bionemo_llama3_te_bshd_mask_lt_minus_one_never_masks", "padding-ignored")
    lengths, longest = [20, 11, 15], 20
    start = [longest - n for n in lengths]
    assert tuple(hit["cell"]) == first((3, longest, longest), lambda b, q, k: k < start[b] <= q), hit
    assert "attention_mask given to NVLlamaModel" in hit["message"], hit


def test_an_additive_mask_turned_into_a_key_padding_mask_by_a_threshold_it_never_passes(tmp_path):
    """The bionemo Llama3 bug written another way: a BERT-style encoder over right-padded sentences keeps HF's
    additive mask, (1 - mask) * -10000, and hands nn.MultiheadAttention `extended < -10000` as its key_padding_mask,
    False everywhere. The first cell and the count are a double loop's (a real query, a padded key); the fix (`< 0`)
    is quiet."""
    [hit] = check_bug(tmp_path, "additive_mask_to_key_padding_threshold_never_holds", "padding-ignored", folder=ARGS)
    lengths, longest = [9, 4, 6], 9
    assert tuple(hit["cell"]) == first((3, longest, longest), lambda b, q, k: q < lengths[b] <= k), hit
    cells = sum(1 for n in lengths for q in range(n) for k in range(longest) if k >= n)
    assert f"{cells} such cells" in hit["message"] and "attention_mask given to SentenceEncoder" in hit["message"], hit


def test_nemotron_asr_eager_additive_mask_logical_not_inverted(tmp_path):
    """huggingface/transformers PR #48817 (closed; the bug is in transformers 5.24; written blind, batch blind-dz): the
    Nemotron ASR streaming encoder's eager path gets an additive float mask (0 / finfo.min) from
    create_bidirectional_mask and applies `masked_fill_(mask.logical_not(), -inf)`: the allowed keys are masked, the
    rest kept. Its `padding_mask` (1 on the 16 and 11 real frames, no ids beside it) is read with 1 = a frame, by its
    rows (read as torch's it would call row 0 all padding). The first cell and the count are a double loop's over the
    chunked mask (chunk 4, one left chunk) turned round; the fix (`mask == 0`) is quiet."""
    [hit] = check_bug(tmp_path, "transformers_nemotron_asr_streaming_eager_float_mask_logical_not_inverted",
                      "padding-ignored")
    lengths, t = [16, 11], 16

    def seen(b, q, k):  # the eager path's mask: the chunked & padding mask turned round
        return not (0 <= q // 4 - k // 4 <= 1 and k < lengths[b])

    assert tuple(hit["cell"]) == first((2, t, t), lambda b, q, k: q < lengths[b] <= k and seen(b, q, k)), hit
    cells = sum(seen(b, q, k) for b in range(2) for q in range(lengths[b]) for k in range(lengths[b], t))
    assert f"{cells} such cells" in hit["message"] and "wrong way round" in hit["message"], hit


def test_a_keras_padding_mask_whose_additive_form_is_cast_to_bool_for_sdpa(tmp_path):
    """The Nemotron bug written another way: a KerasHub-style `padding_mask` (True on the real frames, left-padded, one
    row whole) made additive (0 / -1e9) and handed to SDPA as `extended.bool()`, True where -1e9. The first cell is a
    double loop's (a real query, a padded key it sees); the fix (`extended == 0`) is quiet."""
    [hit] = check_bug(tmp_path, "keras_padding_mask_additive_cast_to_bool_sdpa", "padding-ignored", folder=ARGS)
    counts, t = [6, 4, 2], 6
    assert tuple(hit["cell"]) == first((3, t, t), lambda b, q, k: k < t - counts[b] <= q), hit
    assert "padding_mask given to VideoEncoder" in hit["message"], hit


def test_retro_retrieved_padding_mask_polarity(tmp_path):
    """lucidrains/RETRO-pytorch 0b01736: `mask = retrieved == self.pad_id` kept by an Attention that keeps True: the
    encoder's self-attention over each neighbour chunk (the (batch, chunks, neighbours) axes folded into its rows) sees
    only its padding. The padding is the 4-D `retrieved` ids at the model's stated pad id 0; the first cell is a double
    loop's over the neighbours' lengths (the program pads four of them: rows 1, 2, 4, 7 at 5, 3, 6, 2 tokens)."""
    hit = check_bug(tmp_path, "retro_retrieved_padding_mask_polarity", "padding-ignored")[0]
    lengths = [8, 5, 3, 8, 6, 8, 8, 2]
    assert tuple(hit["cell"][:3]) == first((8, 8, 8), lambda b, q, k: q < lengths[b] <= k)
    assert "`retrieved` (2, 2, 2, 8)" in hit["source"], hit


def test_a_relu_attention_over_right_padded_ids_that_masks_only_its_band(tmp_path):
    """torch-rechub#244's bug written another way: ReLU attention (no softmax) over histories padded on the right
    to the embedding's padding_idx 99, only a band |i - j| <= 2 masked; the first cell is a double loop's (a real
    query, a pad key within its band); the fix ANDs the key mask and is quiet."""
    [hit] = check_bug(tmp_path, "relu_attention_right_padded_band_mask_no_key_padding", "padding-ignored", folder=ARGS)
    lengths = [4, 2, 6]
    assert tuple(hit["cell"]) == first((3, 6, 6), lambda b, q, k: q < lengths[b] <= k and abs(q - k) <= 2), hit
    assert hit["source"].startswith("input ids equal to the pad id 99"), hit


def test_a_divided_space_time_block_whose_time_attention_is_never_given_the_frame_mask(tmp_path):
    """vit-pytorch 4c89017's bug (ViViT's factorized temporal attention never given the frame mask) written another
    way: a TimeSformer-style block's nn.MultiheadAttention over the frames of each patch, folded (patch, batch), clips
    of 4, 2 and 3 frames; the model call's attention_mask says the padded frames. The first cell is a double loop's over
    the clips (a real frame's query, a padded frame's key); the fix (key_padding_mask, folded alike) is quiet."""
    [hit] = check_bug(tmp_path, "timesformer_divided_time_attention_frame_mask_not_passed", "padding-ignored",
                      folder=ARGS)
    frames = [4, 2, 3]
    assert tuple(hit["cell"]) == first((3, 4, 4), lambda b, q, k: q < frames[b] <= k), hit
    assert "attention_mask given to VideoEncoder" in hit["message"], hit


def test_a_static_length_batch_embedded_without_its_attention_mask(tmp_path):
    """optimum-executorch#230's bug written another way: a sentence-embedding export pads every text to the fixed
    length 12 with BertConfig's pad id 0 (no row unpadded) and calls BertModel with the ids alone; the first cell is a
    double loop's (a real query, a pad key); the fix hands the mask and is quiet."""
    [hit] = check_bug(tmp_path, "bert_max_length_batch_embedded_without_attention_mask", "padding-ignored", folder=ARGS)
    lengths = [5, 8]
    assert tuple(hit["cell"]) == first((2, 12, 12), lambda b, q, k: q < lengths[b] <= k), hit
    assert hit["source"].startswith("input ids equal to the pad id 0"), hit


def test_proteins_batched_by_pad_sequence_embedded_without_their_attention_mask(tmp_path):
    """agemagician/Ankh#24's bug written another way: ProtBert-style proteins (lengths 24, 11, 17 with [CLS] and [SEP])
    batched by pad_sequence at BertConfig's pad id 0, BertModel called with the ids alone; the first cell and the count
    are a double loop's (a real query, a pad key); the fix hands the mask built from the lengths and is quiet."""
    [hit] = check_bug(tmp_path, "protbert_pad_sequence_embeddings_without_attention_mask", "padding-ignored",
                      folder=ARGS)
    lengths, width = [24, 11, 17], 24
    assert tuple(hit["cell"]) == first((3, width, width), lambda b, q, k: q < lengths[b] <= k), hit
    cells = sum(1 for b in range(3) for q in range(width) for k in range(width) if q < lengths[b] <= k)
    assert f"{cells} such cells" in " ".join(hit["message"].split()), hit
    assert hit["source"].startswith("input ids equal to the pad id 0"), hit


def test_multiple_choice_candidates_pad_mask_handed_as_keep(tmp_path):
    """Written another way: (batch, choices, tokens) ids flattened to one MHA row per choice, left-padded with the pad
    id its embedding states, the mask of real tokens handed as key_padding_mask; the first cell is a double loop's
    (a real query, a pad key) over the flattened ids; the fix is quiet."""
    status, found, report = traced(tmp_path, "multiple_choice_candidates_pad_mask_as_keep", fixed=False, folder=ARGS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-ignored")
    assert hit["severity"] == "wrong"
    flat = [[1, 1, 4, 5, 6, 7], [7, 8, 9, 3, 2, 5], [1, 1, 1, 6, 4, 9],
            [1, 3, 3, 4, 8, 2], [1, 1, 1, 1, 7, 5], [1, 1, 2, 9, 6, 3]]
    assert tuple(hit["cell"][:3]) == first((6, 6, 6), lambda b, q, k: flat[b][q] != 1 and flat[b][k] == 1)
    status, found, report = traced(tmp_path, "multiple_choice_candidates_pad_mask_as_keep", fixed=True, folder=ARGS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_xlnet_generate_over_left_padding_is_found_without_calling_its_query_stream_a_reversed_mask():
    # transformers' XLNetLMHeadModel.prepare_inputs_for_generation drops the attention_mask, so a left-padded
    # batch's real tokens see its padding (a true bug, kept); the query stream's tokens never see their own key
    # (two-stream attention), which is not a padding mask the wrong way round
    pytest.importorskip("transformers")
    from checkbugs import runner
    from maskcli.commands import app

    result = runner.invoke(app, ["model", "xlnet", "--attn", "eager"])
    text = " ".join(result.output.split())
    assert "padding-ignored: batch row 1: query 2 sees key 0, which input ids equal to the pad id 5 marks as padding" in text
    assert "wrong way round" not in text, result.output


def test_a_softmax_that_masks_nowhere_over_the_stated_padded_tokens_is_attention(tmp_path):
    """A softmax that masks no cell is not read as attention (a router's is over experts), unless its keys are the model
    call's stated tokens and some are padding: BertGeneration's use_cache path (left-padded attention_mask, decode
    steps) and an encoder whose key_padding_mask (True = padding, right-padded) is applied only while training."""
    hit = caught(tmp_path, "softmax_padding_mask_train_only", ("padding-ignored",))
    pad = np.array([[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]], dtype=bool)  # the program's tokens == 1
    # every cell is seen (no mask); the first real query that sees a padding key, by a loop
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: not pad[b, q] and pad[b, k])


def test_src_tokens_at_the_pad_id_their_model_states_are_padding_no_real_query_sees(tmp_path):
    """`src_tokens` (fairseq's, Uni-Mol's name) are the model call's ids where no target side is handed beside them:
    deepmodeling/Uni-Mol#364 (written blind: the collate pads the additive attn_bias with 0, so the padding atoms'
    keys stay open; the model's padding_idx is 0) and a left-padded encoder whose mask uses the wrong id."""
    check_bug(tmp_path, "unimol_tools_v2_collate_pads_attn_bias_with_zero", "padding-ignored")
    hit = caught(tmp_path, "src_tokens_pad_mask_wrong_id", ("padding-ignored",))
    ids = [[2, 5, 7, 3, 9], [1, 1, 4, 6, 8], [1, 1, 1, 10, 11]]
    assert tuple(hit["cell"]) == first((3, 5, 5), lambda b, q, k: ids[b][q] != 1 and ids[b][k] == 1)
    assert "pad id 1" in hit["source"]


def test_source_ids_handed_as_src_at_the_pad_id_are_padding_no_real_query_sees(tmp_path):
    """pytorch/text#2096 (written blind, batch blind-io; caught once real.SOURCE read `src` too): torchtext's T5
    generate ran `encoder(inputs)`, T5Encoder.forward(src=...), with no src_key_padding_mask over right-padded prompts
    (the shared embedding's padding_idx 0). Written another way: an nn.TransformerEncoder sentence encoder scored with
    `model(src)`; the first cell against a loop over the ids."""
    check_bug(tmp_path, "torchtext_t5_generate_encoder_padding_mask_not_passed", "padding-ignored", BLIND)
    hit = check_bug(tmp_path, "src_ids_sentence_encoder_scored_without_key_padding", "padding-ignored", ARGS)[0]
    ids = [[5, 9, 12, 7, 8], [6, 11, 4, 3, 3], [10, 13, 14, 15, 3]]
    assert tuple(hit["cell"]) == first((3, 5, 5), lambda b, q, k: ids[b][q] != 3 and ids[b][k] == 3)
    assert "pad id 3" in hit["source"]


def test_src_tokens_are_not_read_against_an_encoder_decoders_decoder(tmp_path):
    """A model call handed `src_tokens` that also cross-attends is an encoder-decoder: its decoder's self-attention
    is over other tokens (fairseq's prev_output_tokens), so the source's padding is not read on it."""
    program = tmp_path / "seq2seq.py"
    program.write_text(SEQ2SEQ)
    status, found, report = traced(tmp_path, "seq2seq", False, tmp_path)
    assert status == 0 and [f for f in found if f["code"] == "padding-ignored"] == [], report


SEQ2SEQ = '''
import torch
import torch.nn as nn


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.padding_idx = 1
        self.embed = nn.Embedding(12, 8, padding_idx=1)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.decoder = nn.ModuleDict({"self_attn": nn.MultiheadAttention(8, 2, batch_first=True)})
        self.cross_attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, src_tokens, prev_output_tokens):
        pad = src_tokens.eq(self.padding_idx)
        memory = self.encoder(self.embed(src_tokens), src_key_padding_mask=pad)
        x = self.embed(prev_output_tokens)
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) < 0
        x = x + self.decoder["self_attn"](x, x, x, attn_mask=causal, need_weights=False)[0]
        return self.cross_attn(x, memory, memory, key_padding_mask=pad, need_weights=False)[0]


torch.manual_seed(0)
with torch.no_grad():
    Seq2Seq().eval()(torch.tensor([[2, 3, 4, 5], [1, 1, 6, 7]]), torch.tensor([[2, 8, 9, 10], [2, 4, 5, 6]]))
'''


def test_uniem_encoder_called_without_attention_mask(tmp_path):
    """wangyuxinwhy/uniem#23: the pad mask built from the ids (`mask`, right-padded) used for pooling only; the
    model call's ids equal to the pad id say the padding (padding-ignored, said before held.py's padding-unused)."""
    check_bug(tmp_path, "uniem_embedder_encoder_called_without_attention_mask", "padding-ignored")


def test_a_plain_mask_of_real_tokens_stated_to_the_model_catches_a_fill_whose_result_is_discarded(tmp_path):
    """opendilab/DI-engine#333: `score.masked_fill(~mask, -1e9)` out of place, its result discarded; the model call's
    plain `mask` (True = a valid entity, right-padded) states the padding (checks/real.py). Its fix fills in place."""
    check_bug(tmp_path, "ding_entity_transformer_mask_fill_not_inplace", "padding-ignored")


def test_an_input_mask_stated_to_the_model_catches_an_sdpa_bias_filled_out_of_place(tmp_path):
    """The same bug written another way: float features, `input_mask` (1 = real) and SDPA's additive bias filled out
    of place (the bias stays 0)."""
    hit = caught(tmp_path, "sdpa_input_mask_bias_fill_discarded", ("padding-ignored",))
    lengths = [5, 2, 4]
    assert tuple(hit["cell"]) == first((3, 5, 5), lambda b, q, k: q < lengths[b] and k >= lengths[b])
    assert hit["source"] == "input_mask of SetEncoder"


def test_a_plain_mask_is_read_as_padding_only_where_its_rows_are_a_right_padded_batch():
    from types import SimpleNamespace

    from maskcli.checks.real import stated

    def said(mask):
        return stated(SimpleNamespace(arguments={"mask": np.array(mask)}, where="M"), len(mask), len(mask[0]))

    assert said([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])[0].tolist() == [[True] * 4, [True, True, False, False],
                                                                             [True, False, False, False]]
    assert said([[0, 0, 1, 1], [1, 1, 1, 1]]) is None  # a prompt's loss mask: 0s at the start
    assert said([[1, 0, 1, 1], [1, 1, 1, 1]]) is None  # a masked-LM's choice
    assert said([[1, 1, 1], [1, 1, 1]]) is None  # no padding stated
    assert said([[1, 0, 0], [1, 1, 0], [1, 1, 1]]) is None  # square: a causal mask over the cells


def test_a_left_padded_batch_without_a_mask_is_found_by_the_pad_id_of_a_tokenizer_a_collator_keeps(tmp_path):
    """fla-org/flame#24: the collator pads on the left (its tokenizer's pad id 0) and returns no attention_mask, so the
    dense causal kernel lets real tokens attend the padding; the tokenizer is the collator's (`collator.tokenizer`)."""
    found = check_bug(tmp_path, "flame_collator_padded_batch_without_attention_mask", "padding-ignored")
    lengths = (7, 4, 2)
    real = lambda b, i: i >= 7 - lengths[b]  # noqa: E731
    bad = lambda b, q, k: real(b, q) and not real(b, k) and k <= q  # noqa: E731
    assert tuple(found[0]["cell"]) == first((3, 7, 7), bad)
    assert "collator.tokenizer" in found[0]["message"] and "(step 0; 22 such cells)" in found[0]["message"]


def test_ids_scored_without_their_mask_are_found_by_the_pad_id_of_the_tokenizer_an_object_keeps(tmp_path):
    """The same gap written another way: a scorer keeps `self.tokenizer` (pad id 3, left) and calls its eager-softmax
    LM with the ids alone."""
    hit = caught(tmp_path, "scorer_left_padded_ids_without_mask", ("padding-ignored",))
    lengths = (5, 2, 3)
    real = lambda b, i: i >= 5 - lengths[b]  # noqa: E731
    assert tuple(hit["cell"]) == first((3, 5, 5), lambda b, q, k: real(b, q) and not real(b, k) and k <= q)
    assert "self.tokenizer (Vocab)" in hit["message"]

QUIET = Path(__file__).parent / "data" / "quiet"


def test_a_perceivers_latents_are_not_read_against_its_frames_padding(tmp_path):
    """lucidrains' Perceiver: latents cross-attend to the frames (their padding masked) and then to themselves, as many
    latents as frames. The frames' attention_mask says nothing of the latents: quiet. The same model whose cross-attention
    drops the mask is still found (a real query sees key 2 of row 1, the first padded frame by a loop)."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "perceiver_latents_as_many_as_frames", False, QUIET)
    assert status == 0 and found == [], report
    source = (QUIET / "perceiver_latents_as_many_as_frames.py").read_text()
    dropped = source.replace("cross_attn(x, context=data, mask=mask)", "cross_attn(x, context=data)")
    assert dropped != source
    (tmp_path / "frames_mask_dropped.py").write_text(dropped)
    status, found, report = traced(tmp_path, "frames_mask_dropped", False, tmp_path)
    hit = next(f for f in found if f["code"] == "padding-ignored")
    real = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=bool)
    assert status == 1 and tuple(hit["cell"]) == first((2, 4, 4), lambda b, q, k: real[b, q] and not real[b, k]), report


def test_a_media_towers_frames_are_not_read_against_the_texts_attention_mask(tmp_path):
    """A speech LM's `audio_tower` attends its clips' frames (as many as the text's tokens) under their own frame mask;
    the text's left-padded attention_mask says nothing of them: quiet (quiet-r66a's Qwen2-Audio was a false alarm so).
    The same model whose text decoder drops the attention_mask is still found, on the decoder's call."""
    from checkbugs import traced

    name = "speech_lm_audio_tower_frames_as_many_as_text_tokens"
    status, found, report = traced(tmp_path, name, False, QUIET)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
    source = (QUIET / f"{name}.py").read_text()
    dropped = source.replace("keep = torch.ones(n, n, dtype=torch.bool).tril() & attention_mask.bool()[:, None, None, :]",
                             "keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None]")
    assert dropped != source
    (tmp_path / "text_mask_dropped.py").write_text(dropped)
    status, found, report = traced(tmp_path, "text_mask_dropped", False, tmp_path)
    hits = [f for f in found if f["code"] == "padding-ignored"]
    ids = [[0, 0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
    assert status == 1 and len(hits) == 1 and "given to SpeechLM" in hits[0]["message"], report
    assert tuple(hits[0]["cell"]) == first((2, 8, 8), lambda b, q, k: k <= q and ids[b][q] != 0 and ids[b][k] == 0)


def test_x_transformers_flash_attend_bool_mask_inverted(tmp_path):
    """x-transformers#160: the "True = mask out" mask handed to SDPA (True = attend): real queries see the padding
    keys 4, 5 of row 1 that the `mask` given to Attention marks padding; the fix (`mask = ~mask`) is quiet."""
    hit = check_bug(tmp_path, "x_transformers_flash_attend_bool_mask_inverted", "padding-ignored")[0]
    assert hit["message"].startswith("batch row 1: query 0 sees key 4, which the mask given to Attention marks as padding")


def test_kyubyong_key_masks_from_position_encoded_keys(tmp_path):
    """Kyubyong/transformer#69: the pad id is the embedding row zeroed by hand (TF's zero_pad), the ids are the model's
    first argument `x`, and the (h * N, T, T) scores fold the heads onto the batch head-major; keys tested for zero
    after the positional encoding was added, so nothing is masked. Read both ways round, the first cell is a double
    loop's over the head-major reading (row r is sample r % 2)."""
    found = check_bug(tmp_path, "kyubyong_transformer_key_masks_from_position_encoded_keys", "padding-ignored")
    x = [[5, 9, 3, 7, 2, 4], [8, 6, 2, 0, 0, 0]]
    assert tuple(found[0]["cell"]) == first((8, 6, 6), lambda r, q, k: x[r % 2][q] != 0 and x[r % 2][k] == 0)
    assert "(of the batch of 2 folded with its 4 heads, either way round)" in found[0]["message"]


def test_zero_pad_row_keys_from_positions(tmp_path):
    """Written another way: pad id 1 zeroed by hand, a left-padded batch handed as `words`, heads folded batch-major
    (reshape(B * h)), a learned position embedding; the first cell is a double loop's over the batch-major reading."""
    status, found, report = traced(tmp_path, "zero_pad_row_keys_from_positions", False, ROWS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-ignored")
    assert hit["severity"] == "wrong"
    words = [[1, 1, 5, 6, 7], [8, 9, 10, 11, 12], [1, 13, 14, 15, 16]]
    assert tuple(hit["cell"]) == first((12, 5, 5), lambda r, q, k: words[r // 4][q] != 1 and words[r // 4][k] == 1)
    status, found, report = traced(tmp_path, "zero_pad_row_keys_from_positions", True, ROWS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


@pytest.mark.parametrize("name, model", [("baichuan13b_alibi_forward_ignores_attention_mask", "BaichuanModel"),
                                         ("dnabert_extended_attention_mask_typo_leaves_padding_unmasked", "BertModel")])
def test_a_model_that_builds_its_mask_without_the_attention_mask_it_was_given(tmp_path, name, model):
    """Written blind, caught before any rule was changed for them: Baichuan-13B#79 (ALiBi's mask alone, the
    attention_mask never added) and DNABERT#102 (a typo leaves the extended mask unscaled: 0/1 added, padding kept).
    Their fixes are quiet."""
    found = check_bug(tmp_path, name, "padding-ignored")
    assert f"which the attention_mask given to {model} marks as padding" in found[0]["message"]


def test_a_left_padded_prefill_over_a_caches_first_slots_is_read_by_the_pad_id_its_generate_states(tmp_path):
    """torchtune#1250 (written blind): the cache's `tril` cut at `input_pos` over 12 slots, the pad id only
    `generate(..., pad_id=0)`'s; written another way: a `cache_position` argument, a softmax of the program's own, pad id
    2 stated by `sample(..., pad_token_id=2)`. Both fixes (the padding anded into the mask) are quiet."""
    found = check_bug(tmp_path, "torchtune_eleuther_eval_batched_generate_left_padding_kv_cache", "padding-ignored")
    ids = [[5, 9, 13, 17, 21, 25], [0, 0, 0, 0, 7, 11]]
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: k <= q and ids[b][q] != 0 and ids[b][k] == 0)
    assert "pad_id=0 in generate()" in found[0]["source"]
    hit = caught(tmp_path, "static_cache_prefill_pad_id_local", ("padding-ignored",))
    ids = [[5, 6, 7, 8, 9], [2, 2, 11, 12, 13]]
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: k <= q and ids[b][q] != 2 and ids[b][k] == 2)
    assert "pad_token_id=2 in sample()" in hit["source"]


def test_ferritin_esm2_attention_ignores_padding_mask(tmp_path):
    """ferritin#199: ESM2's attention_mask used only for token-dropout rescaling, never in the softmax
    (written blind, batch blind-n; caught before any rule was changed for it)."""
    from checkbugs import check_bug

    check_bug(tmp_path, "ferritin_esm2_attention_ignores_padding_mask", "padding-ignored")


def test_trl_ppo_batched_forward_pass_seq2seq_no_attention_mask(tmp_path):
    """trl#139: PPO's batched forward pass hands the seq2seq policy only input_ids: the padding attended
    (written blind, batch blind-o; caught before any rule was changed for it)."""
    from checkbugs import check_bug

    check_bug(tmp_path, "trl_ppo_batched_forward_pass_seq2seq_no_attention_mask", "padding-ignored")


def test_unsloth_grpo_accumulated_loss_left_padded_no_attention_mask(tmp_path):
    """unsloth#3176: GRPO's accumulated loss runs the left-padded batch with is_causal and no attention_mask
    (written blind, batch blind-p; caught before any rule was changed for it)."""
    check_bug(tmp_path, "unsloth_grpo_accumulated_loss_left_padded_no_attention_mask", "padding-ignored")


def _packed_leak(segments: list[list[int]], positions: list[list[int]]):
    """bad(b, q, k) of a causal mask over packed rows: a real query at or after a key of another document (a new one
    where the position restarts at 0 after a real token; segment number 0 = padding), by a loop over positions."""
    def document(b, i):
        return sum(1 for j in range(1, i + 1) if positions[b][j] == 0 and segments[b][j] and segments[b][j - 1])

    def bad(b, q, k):
        padding_q = positions[b][q] == 0 and (q + 1 == len(positions[b]) or positions[b][q + 1] == 0)
        return k <= q and segments[b][k] != 0 and not padding_q and document(b, q) != document(b, k)
    return bad


def test_an_attention_mask_of_packed_sample_numbers_is_real_tokens_not_one_document(tmp_path):
    # axolotl-ai-cloud/axolotl#3796 (written blind, batch blind-s): the multipack collator's attention_mask numbers
    # the samples (1, 1, 1, 1, 2, 2, 2, 3, ...); kept for sdpa, it is cast to bool and the documents leak
    found = check_bug(tmp_path, "axolotl_multipack_sdpa_keeps_segment_attention_mask", "documents-leak")
    segments = [[1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 0]]
    positions = [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 0]]
    assert tuple(found[0]["cell"]) == first((1, 12, 12), _packed_leak(segments, positions))
    # written another way: two rows, one padded at its start, an eager softmax with an additive mask
    found = check_bug(tmp_path, "segment_numbers_mask_read_as_padding", "documents-leak",
                      Path(__file__).parent / "data" / "packed")
    segments = [[0, 0, 1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 3, 3, 3, 3]]
    positions = [[0, 0, 0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 0, 1, 2, 3]]
    assert tuple(found[0]["cell"]) == first((2, 9, 9), _packed_leak(segments, positions))


def _prompt_then_completion(ids: list[list[int]], pad: int):
    """bad(b, q, k) of a causal mask: a real query (not the pad id) sees a key in the pad-id run at its row's start,
    by a loop over positions."""
    def bad(b, q, k):
        leading = all(ids[b][j] == pad for j in range(k + 1))
        return k <= q and ids[b][q] != pad and leading
    return bad


def test_left_padded_prompts_then_right_padded_completions_scored_with_no_mask(tmp_path):
    # huggingface/trl#2708 (written blind, batch blind-s): GRPO's per-token log-probs over prompt + completion ids with
    # no attention_mask; the processing class states pad id 0 and left padding
    found = check_bug(tmp_path, "trl_grpo_per_token_logps_without_attention_mask", "padding-ignored")
    ids = [[5, 6, 7, 8, 9, 10, 20, 21, 2, 0], [5, 6, 7, 8, 9, 10, 22, 2, 0, 0],
           [0, 0, 0, 0, 11, 12, 23, 24, 25, 2], [0, 0, 0, 0, 11, 12, 26, 2, 0, 0]]
    assert tuple(found[0]["cell"]) == first((4, 10, 10), _prompt_then_completion(ids, 0))
    # written another way: a critic's eager softmax, the pad id its own dataclass config states, no tokenizer
    found = check_bug(tmp_path, "rollout_prompt_response_ids_no_mask", "padding-ignored",
                      Path(__file__).parent / "data" / "tokens")
    ids = [[4, 5, 6, 7, 10, 11, 1], [1, 1, 8, 9, 12, 13, 14]]
    assert tuple(found[0]["cell"]) == first((2, 7, 7), _prompt_then_completion(ids, 1))


def test_alphafold3_template_embedder_mask_not_forwarded(tmp_path):
    """lucidrains/alphafold3-pytorch 43ccb98: TemplateEmbedder repeats the residue mask per template but runs its
    pairformer stack without it, so triangle attention over (batch, template, row) folded rows attends padded residues
    (written blind, batch blind-x; caught before any rule was changed for it). Complexes of 5 and 3 residues: the
    padded keys of the second are 3 and 4, whichever way the batch is folded."""
    [hit] = check_bug(tmp_path, "alphafold3_template_embedder_mask_not_forwarded", "padding-ignored")
    assert "either way round" in hit["message"] and hit["cell"][2] in (3, 4)
    # (its heads are an axis of their own, (20, 2, 5, 5): the fold is 2 complexes x 2 templates x 5 rows, not heads)
    assert "(of the batch of 2 folded with 10 rows of another axis each, either way round)" in hit["message"]


def test_ankh_feature_extraction_without_attention_mask(tmp_path):
    """agemagician/Ankh#24: the README's feature extraction keeps only input_ids of a padded batch, so the shorter
    protein (9 residues + </s> = 10 tokens) attends its pads (written blind, batch blind-x; caught before any rule
    was changed for it)."""
    pytest.importorskip("transformers")
    [hit] = check_bug(tmp_path, "ankh_feature_extraction_without_attention_mask", "padding-ignored")
    assert hit["cell"][0] == 1 and hit["cell"][2] >= 10


# a model whose `forward` the program calls directly (no module call of the model runs, only its layers'): that call,
# read from the frame around its layers' calls (trace/outer.py), states the batch's padding by its ids

def test_exllama_generate_simple_batch_ignores_padding_mask(tmp_path):
    """turboderp/exllama 899aaa0: batched generate_simple calls `model.forward(ids, cache)` without the left-padding
    mask: the prompts' pads (config.pad_token_id 0) are attended (written blind, batch blind-y; caught once trace read
    a directly called forward as the model's call). Fix quiet."""
    found = check_bug(tmp_path, "exllama_generate_simple_batch_ignores_padding_mask", "padding-ignored")
    ids = [[0, 0, 0, 0, 1, 3], [1, 7, 8, 5, 9, 10]]  # the prefill's input ids, left-padded with 0
    expected = first((2, 6, 6), lambda b, q, k: ids[b][q] != 0 and k <= q and ids[b][k] == 0)
    assert tuple(found[0]["cell"]) == expected


def test_a_padding_ignored_under_a_model_forward_called_directly_is_found(tmp_path):
    """The same bug written otherwise: the pad id stated by nn.Embedding(padding_idx=5) alone, SDPA with is_causal,
    a batch of three left-padded prompts."""
    hit = caught(tmp_path, "padding_ignored_model_forward_called_directly", ("padding-ignored",))
    ids = [[5, 5, 5, 7, 8], [5, 9, 10, 11, 12], [13, 14, 15, 16, 17]]
    expected = first((3, 5, 5), lambda b, q, k: ids[b][q] != 5 and k <= q and ids[b][k] == 5)
    assert tuple(hit["cell"]) == expected


def test_kivi_mistral_flash_prefill_drops_padding_mask(tmp_path):
    """jy-yuan/KIVI#47 (f138c47): the flash-attention prefill of a left-padded batch hands the kernel no padding mask,
    so the real queries attend the pads (written blind, batch blind-ae; caught before any rule was changed for it).
    The fix (each sequence unpadded, its own call) is quiet."""
    pytest.importorskip("transformers")  # (its MistralConfig)
    check_bug(tmp_path, "kivi_mistral_flash_prefill_drops_padding_mask", "padding-ignored")


# a plain `mask` whose 0s lead each row is the batch's padding where the ids beside it hold one id at exactly those
# cells (checks/plainpad.py): a prompt's loss mask covers varied ids

def test_x_transformers_autoregressive_wrapper_drops_input_mask(tmp_path):
    """lucidrains/x-transformers d69d33c: AutoregressiveWrapper popped a `mask` already sized for `x[:, :-1]` and never
    put it back (written blind, batch blind-v; caught once a left-padded plain mask was read against the ids, one
    longer, at the pad id 0). The first cell: a real query that sees a key the mask calls padding, under the causal
    mask the layers still apply. The fix keeps that version's mask on the queries as well as the keys (`q_mask *
    k_mask`, lucidrains' DALLE-pytorch 9bf1f0f slip): each left-padded row's pad queries see no key and take uniform
    weights over every key under the finite fill, and the loss (ignore_index 0, the pad id) counts the last pad row's
    target, the row's first real token, which that row attends: empty-rows-trained, true of the fix, and its only
    wrong finding."""
    status, found, report = traced(tmp_path, "x_transformers_autoregressive_wrapper_drops_input_mask", False)
    assert status == 1, report
    found = [f for f in found if f["code"] == "padding-ignored" and f["severity"] == "wrong"]
    real = [[True] * 9, [False] * 4 + [True] * 5, [False] * 7 + [True] * 2]  # lengths 10, 6, 3 left-padded, minus one
    assert "the mask given to AutoregressiveWrapper" in found[0]["message"]
    assert tuple(found[0]["cell"]) == first((3, 9, 9), lambda b, q, k: real[b][q] and not real[b][k] and k <= q)
    status, fixed, report = traced(tmp_path, "x_transformers_autoregressive_wrapper_drops_input_mask", True)
    wrong = [f for f in fixed if f["severity"] == "wrong"]
    assert {f["code"] for f in wrong} == {"empty-rows-trained"}, report
    last_pad = [(b, q) for b in range(3) for q in range(9) if not real[b][q] and q + 1 < 9 and real[b][q + 1]]
    assert {tuple(f["cell"][:2]) for f in wrong} <= set(last_pad) and "(2 such rows in all)" in wrong[0]["message"]


def test_an_input_mask_dropped_for_is_causal_on_a_left_padded_batch_is_found(tmp_path):
    """The same bug written otherwise: SDPA's is_causal alone, the `input_mask` as long as the ids (pad id 2, stated by
    no config or embedding)."""
    hit = caught(tmp_path, "input_mask_left_padded_dropped_for_is_causal", ("padding-ignored",))
    real = [[True] * 6, [False] * 3 + [True] * 3, [False] * 2 + [True] * 4]
    assert tuple(hit["cell"]) == first((3, 6, 6), lambda b, q, k: real[b][q] and not real[b][k] and k <= q)


def test_olmo_core_grpo_logprobs_without_doc_lens(tmp_path):
    """allenai/open-instruct#1670: OLMo-core GRPO's forward_for_logprobs drops doc_lens, so packed rollouts attend
    across documents (written blind, batch blind-ab; caught before any rule was changed for it). The fix is quiet."""
    check_bug(tmp_path, "olmo_core_grpo_logprobs_without_doc_lens", "documents-leak")


def test_nemotron_asr_streaming_eager_chunk_mask_inverted(tmp_path):
    """huggingface/transformers#48817: NemotronAsrStreaming's eager path treats its additive chunk mask as bool,
    applied inverted (batch blind-ai); written blind and caught before any rule was changed for it. The fix is
    quiet."""
    check_bug(tmp_path, "nemotron_asr_streaming_eager_chunk_mask_inverted", "padding-ignored")


def test_mlx_embedders_qwen3_attention_mask_discarded(tmp_path):
    """ml-explore/mlx-swift-lm#418: the Qwen3 embedder discards the caller's attention mask, so left-padded texts
    attend their pads (batch blind-aj); written blind and caught before any rule was changed for it. The fix is
    quiet."""
    check_bug(tmp_path, "mlx_embedders_qwen3_attention_mask_discarded", "padding-ignored")


def test_colossalai_pipeline_gpt_raw_mask_on_later_stage(tmp_path):
    """hpcaitech/ColossalAI#430: only the first pipeline stage turns the 0/1 attention mask into a bias; later stages
    add it raw (batch blind-ak); written blind and caught before any rule was changed for it. The fix is quiet."""
    check_bug(tmp_path, "colossalai_pipeline_gpt_raw_mask_on_later_stage", "padding-ignored")


def test_a_pad_mask_one_on_the_tokens_is_read_by_its_ids(tmp_path):
    """vllm-project/semantic-router#3406 (blind-ax): candle's ModernBERT flash path calls flash_attn with neither the
    local window nor the padding. Its `pad_mask` (a name both conventions use) is 1 on the tokens: read as torch's it
    would call row 0 all padding, while the ids hold the pad id 0 at each of its 0s and nowhere else, so its 1s are the
    tokens (checks/real.py). Its first cell against a double loop over the right-padded rows (lengths 12, 7): a real
    query that sees a padding key. The fix (a windowed kernel given window_left and window_right) is quiet."""
    [hit] = check_bug(tmp_path, "modernbert_candle_flash_path_drops_local_window_and_padding", "padding-ignored")
    lengths = (12, 7)
    assert tuple(hit["cell"]) == first((2, 12, 12), lambda b, q, k: q < lengths[b] <= k)


def test_key_padding_repeated_head_major_onto_batch_major_bmm_scores(tmp_path):
    """Written another way than ProphetNet's: a text encoder's `torch.bmm` scores of queries reshaped (B, H, L, D) to
    (B * H, L, D), masked_fill(-inf) with the key padding `.repeat(heads, 1)` (head-major). Batch-major, row n is sample
    n // H: the finding's row, read by a loop over the padded ids, is a row whose sample is shorter than the mask the
    repeat laid on it; the fix (repeat_interleave) is quiet."""
    texts = [[4, 9, 13, 2, 7], [5, 3, 8], [11, 6, 2, 9]]
    heads, width = 3, 5
    lengths = [len(t) for t in texts]
    laid = [lengths[n % len(texts)] for n in range(len(texts) * heads)]  # what .repeat(heads, 1) lays on row n
    name = "encoder_key_padding_repeat_not_interleaved_bmm"
    folder = Path(__file__).parent / "data" / "folded"
    status, found, report = traced(tmp_path, name, False, folder)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "padding-ignored" and f["severity"] == "wrong"]
    row, _, key = hit["cell"]
    assert "batch-major" in hit["message"] and lengths[row // heads] <= key < laid[row] <= width, report
    status, found, report = traced(tmp_path, name, True, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


BATCHDICT = Path(__file__).parent / "data" / "batchdict"


def test_ids_held_in_a_batch_dict_with_a_target_item_appended(tmp_path):
    """datawhalechina/torch-rechub b0c1516 (blind-ba, missed before): BST runs nn.TransformerEncoder over a history
    right-padded with item 0 (the item embedding's padding_idx) and the target item appended, with no
    src_key_padding_mask; the ids reach the model inside its batch dict `x`. The 8 ids are 8 of the 9 keys, at the
    start or the end: the cell named is a double loop's over cells that are a real query seeing a pad key either way
    (history lengths 8, 3, 5). The fix (the padding mask, the target kept) is quiet."""
    [hit] = check_bug(tmp_path, "torch_rechub_bst_behavior_sequence_padding_unmasked", "padding-ignored")
    lengths = [8, 3, 5]
    assert tuple(hit["cell"]) == first((3, 9, 9), lambda b, q, k: q < lengths[b] and lengths[b] + 1 <= k <= 7), hit
    assert hit["source"].startswith('input ids x["hist_movie_id"] equal to the pad id 0'), hit


def test_ids_held_in_a_batch_dict_left_padded_with_a_cls_key_prepended(tmp_path):
    """The same bug written another way (RecBole's `interaction` dict, sequences left-padded with item 0, a CLS token
    prepended, a hand-written encoder on SDPA with no mask): caught, the cell a double loop's over cells a real query
    sees a pad key under either placement of the 8 ids among the 9 keys; the fix (mask from `item_seq != 0`, the CLS
    kept) is quiet."""
    [hit] = check_bug(tmp_path, "recbole_style_interaction_dict_cls_keys_unmasked", "padding-ignored", folder=BATCHDICT)
    lengths = [8, 3, 5]
    assert tuple(hit["cell"]) == first((3, 9, 9), lambda b, q, k: q >= 9 - lengths[b] and 1 <= k <= 7 - lengths[b]), hit
    assert 'interaction["item_seq"]' in hit["source"], hit


def test_ids_held_in_a_nested_text_field_dict_handed_to_bert_without_a_mask(tmp_path):
    """allenai/allennlp#3465, fixed by PR allenai/allennlp#3560 (written blind, batch blind-cz): the
    PretrainedTransformerEmbedder called BertModel with the token ids only, which reach the model call nested in
    AllenNLP's TextFieldTensors (`{"bert": {"token_ids": ...}}`), right-padded with the embedding's padding_idx 0. The
    cell named is a double loop's over a real query of the shorter row seeing a pad key (lengths 10, 6); the fix (the
    indexer's mask handed on as attention_mask) is quiet."""
    [hit] = check_bug(tmp_path, "allennlp_pretrained_transformer_embedder_drops_attention_mask", "padding-ignored")
    lengths = [10, 6]
    assert tuple(hit["cell"]) == first((2, 10, 10), lambda b, q, k: q < lengths[b] <= k), hit
    assert hit["source"].startswith('input ids text_field_input["bert"]["token_ids"] equal to the pad id 0'), hit


def test_ids_held_in_a_nested_text_field_dict_left_padded_mha_unmasked(tmp_path):
    """The same bug written another way: an AllenNLP-style classifier handed `{"tokens": {"tokens": ids}}` left-padded
    with padding_idx 1, nn.MultiheadAttention never given a key_padding_mask: caught, the cell a double loop's over a
    real query seeing a left pad key (lengths 7, 4, 2); the fix (key_padding_mask from the ids) is quiet."""
    [hit] = check_bug(tmp_path, "allennlp_style_nested_text_field_left_padded_mha_unmasked", "padding-ignored",
                      folder=BATCHDICT)
    lengths = [7, 4, 2]
    assert tuple(hit["cell"]) == first((3, 7, 7), lambda b, q, k: q >= 7 - lengths[b] and k < 7 - lengths[b]), hit
    assert 'tokens["tokens"]["tokens"]' in hit["source"], hit


def test_packed_samples_stated_by_qwen2_vl_rope_ids_that_the_model_no_longer_reads_are_found(tmp_path):
    """hiyouga/EasyR1#494 (written blind, batch blind-cd): the padding-free actor hands Qwen2-VL (3, 1, nnz) mrope
    position_ids of two samples, which restart at 0 at the second; transformers reads packed samples from a 4th text
    row only, so the mask is plain causal. Fixed: the (4, 1, nnz) ids, and the per-sample mask transformers builds."""
    [hit, *_] = check_bug(tmp_path, "easyr1_qwen2vl_rmpad_mrope_position_ids_drop_text_ids", "documents-leak")
    assert hit["message"].startswith("position_ids restart at 0 (packed documents) but query 7 of batch row 0 sees key 0")


def test_packed_samples_stated_by_multimodal_rope_ids_an_image_opens_are_found(tmp_path):
    """Written another way: a hand-written VLM decoder given (3, 1, nnz) t/h/w rope ids, the second sample opening
    with a 2x2 image (its w row restarts at 0 inside the image: only all three at 0 start a sample), under SDPA's
    is_causal=True. Fixed: a block-diagonal causal mask from where all three rows restart."""
    [hit, *_] = check_bug(tmp_path, "packed_vlm_mrope_ids_sdpa_is_causal", "documents-leak",
                          Path(__file__).parent / "data" / "mrope")
    assert hit["cell"] == [0, 5, 0]


def test_multimodal_rope_ids_read_as_one_position_per_token_against_a_loop():
    """flat_positions: the text row of 4, else the largest of 3 (t, h, w); documents start where that restarts."""
    from maskcli.checks.arguments import flat_positions

    t = [0, 1, 2, 0, 0, 0, 0, 2]
    h = [0, 1, 2, 0, 0, 1, 1, 2]
    w = [0, 1, 2, 0, 1, 0, 1, 2]
    rope = np.array([t, h, w])[:, None, :]
    flat = flat_positions({"mrope_position_ids": rope})
    assert flat.tolist() == [[max(t[i], h[i], w[i]) for i in range(8)]]
    starts = [i for i in range(1, 8) if t[i] == h[i] == w[i] == 0]  # a sample's first token: all three rows at 0
    assert document_starts(flat, None).tolist() == [[sum(1 for s in starts if s <= i) for i in range(8)]]
    text = np.array([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert flat_positions({"mrope_position_ids": np.concatenate([text[None], rope])}).tolist() == text.tolist()
    assert flat_positions({"position_ids": text, "mrope_position_ids": rope}) is text
def test_bert_tf_port_minus_1e4_padding_mask_leaks_under_outlier_scores(tmp_path):
    """huggingface/transformers#17306 (written blind, batch blind-ce; caught before tuning, and its fix called
    padding-per-head): BERT's `(1 - mask) * -10000.0` added to scores that span about ±1.6e5 lowers the padded keys less
    than the scores differ, so real queries read them. The finding says so rather than "a mask the wrong way round" (the
    real keys softmax zeroes are the scores' own: trace/finitefill.py); the fix's finfo.min is quiet."""
    [hit] = check_bug(tmp_path, "transformers_bert_tf_port_minus_1e4_padding_mask_leaks", "padding-ignored")
    assert "additive mask lowers a padded key less than the scores differ" in hit["message"]
    assert tuple(hit["cell"]) == (0, 0, 6)  # (row 0's first real query; its keys 6-7 are the pads)


def test_an_additive_mask_outweighed_by_outlier_scores_over_a_left_padded_batch(tmp_path):
    """The same bug written another way: a RoBERTa-style encoder over a left-padded batch (pad id 1), einsum scores
    unscaled, `(mask - 1) * 10000` added: found at a real query and a key at the pad id (the batch's ids, written
    here); its finfo.min fix is quiet."""
    fills = Path(__file__).parent / "data" / "fills"
    status, found, report = traced(tmp_path, "outlier_scores_additive_padding", fixed=False, folder=fills)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-ignored" and f["severity"] == "wrong")
    b, q, k = hit["cell"]
    ids = [[1, 1, 7, 8, 9, 10, 11], [1, 12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24]]
    assert ids[b][k] == 1 and ids[b][q] != 1  # a real query, a key at the pad id
    assert "less than the scores differ" in hit["message"]
    status, found, report = traced(tmp_path, "outlier_scores_additive_padding", fixed=True, folder=fills)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_protein_tokens_from_a_batch_converter_embedded_without_their_mask(tmp_path):
    """Ankh#24's bug written another way: an ESM-style batch converter (<cls> residues <eos>, right-padded with the
    alphabet's padding_idx 1, which EsmConfig states) hands `tokens` positionally to EsmModel; the first cell is a
    double loop's (a real query, a pad key); the fix hands tokens.ne(padding_idx) and is quiet."""
    [hit] = check_bug(tmp_path, "esm_batch_converter_tokens_embedded_without_mask", "padding-ignored", folder=ARGS)
    lengths = [23 + 2, 16 + 2, 7 + 2]
    assert tuple(hit["cell"]) == first((3, 25, 25), lambda b, q, k: q < lengths[b] <= k), hit
    assert hit["source"].startswith("input ids equal to the pad id 1"), hit


def test_a_left_padded_mlm_collate_that_returns_no_attention_mask(tmp_path):
    """deepchem#3597's bug written another way: a DataLoader collate_fn pads on the left with the tokenizer's pad id 0,
    masks tokens and returns input_ids and labels only, and DistilBertForMaskedLM trains on them; the first cell is a
    double loop's over the left-padded rows; the fix returns the attention_mask and is quiet."""
    found = check_bug(tmp_path, "mlm_collate_left_padded_without_attention_mask", "padding-ignored", folder=ARGS)
    lengths = [17 + 2, 4 + 2, 22 + 2]  # letters of each text without spaces, [CLS] and [SEP]
    real = lambda b, i: i >= 24 - lengths[b]  # noqa: E731
    assert tuple(found[0]["cell"]) == first((3, 24, 24), lambda b, q, k: real(b, q) and not real(b, k)), found
    assert found[0]["source"].startswith("input ids equal to the pad id 0"), found


def test_a_generate_loop_whose_inputs_drop_the_attention_mask_is_flagged(tmp_path):
    # written another way: a config object's pad_token_id, SDPA, a cache kept in a list, and prepare_inputs that
    # leave the left-padded prompts' attention_mask out of every step
    found = check_bug(tmp_path, "generate_prepare_inputs_drops_attention_mask", "padding-ignored", folder=ARGS)
    pads = (0, 2)
    assert tuple(found[0]["cell"]) == first((2, 5, 5), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)


def test_a_time_major_query_copied_batch_major_beside_a_head_major_padding_is_flagged(tmp_path):
    # written another way: (T, B, H, D) projections copied to B * H rows with permute(1, 2, 0, 3).reshape, a left-padded
    # batch of three, the model call's attention_mask tiled with .repeat(heads, T, 1); matmul, masked_fill out of place
    found = check_bug(tmp_path, "time_major_heads_folded_batch_major_mask_repeated_head_major", "padding-ignored",
                      folder=ARGS)
    pads, samples, heads, length = (0, 3, 1), 3, 2, 6

    def bad(n, q, k):  # row n is sample n // heads (the query's layout); its mask is sample n % samples's (the repeat)
        own, laid = pads[n // heads], pads[n % samples]
        return q >= own and k < own and k >= laid

    assert tuple(found[0]["cell"]) == first((samples * heads, length, length), bad)


def test_fms_pad_input_ids_flagging_pads_by_a_non_zero_pad_value_is_said_as_padding(tmp_path):
    """foundation-model-stack/foundation-model-stack 32bfbc8 (written blind, batch blind-eg): `pad_input_ids` flagged
    pads with `pads.bool()`, so StarCoder's <fim_pad> = 4 made every pad real. No mask names the padding: the ids lead
    with a run of 4 where the position_ids stay 0 (checks/idspositions.py), and the real queries of the short prompt
    see those keys (said as padding, not as packed documents); the fix (`is_pad` zeros) is quiet."""
    found = check_bug(tmp_path, "fms_gpt_bigcode_pad_input_ids_nonzero_pad_mask_attends_pads", "padding-ignored")
    pads = (12 - 7, 0)
    assert tuple(found[0]["cell"]) == first((2, 12, 12), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)
    assert found[0]["source"].startswith("input ids padded with 4"), found


def test_a_keep_mask_from_the_pad_id_it_assumed_is_flagged_by_the_ids_and_positions(tmp_path):
    # fms 32bfbc8's bug written another way: a RoPE decoder, a boolean SDPA keep mask from `ids != 0` while the prompts
    # are left-padded with 2 (the EOS), positions filled with 1 over the pads as Hugging Face's cumsum - 1 does
    found = check_bug(tmp_path, "batched_prompts_pad_mask_from_zero_id_eos_padded", "padding-ignored", folder=ARGS)
    pads = (9 - 4, 0)
    assert tuple(found[0]["cell"]) == first((2, 9, 9), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)


def test_surya_order_boxes_unmasked_by_count_over_left_padding_is_flagged(tmp_path):
    """VikParuchuri/surya f82a06e (written blind, batch blind-eg): the reading-order decoder unmasks the boxes'
    columns [0, box_count) for box-to-box attention, but the boxes are left-padded, so real boxes see PAD boxes. The
    decoder is handed `input_boxes_mask`, whose 0s are exactly the PAD boxes of `input_boxes` (trace/padded.py's
    input_mask, checks/plainpad.py); the fix unmasks [pad_len, max_boxes) and is quiet."""
    found = check_bug(tmp_path, "surya_ordering_mbart_order_decoder_boxes_mask_counts_ignore_left_padding",
                      "padding-ignored")
    pads, counts = (5, 1), (3, 7)  # 3 and 7 boxes padded to 8; boxes unmasked on columns [0, count)

    def bad(b, q, k):
        return q >= pads[b] and k < min(pads[b], counts[b])

    assert tuple(found[0]["cell"]) == first((2, 8, 8), bad)


def test_cells_unmasked_up_to_the_batch_longest_over_right_padding_are_flagged(tmp_path):
    # surya f82a06e's bug written another way: right-padded table cells (row, column) with their input_cells_mask,
    # nn.MultiheadAttention, the both-ways span unmasked up to counts.max() instead of each row's count
    found = check_bug(tmp_path, "table_cells_prefix_span_batch_wide_attends_pad_cells", "padding-ignored", folder=ARGS)
    counts = (3, 6)
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: q < counts[b] <= k)


def test_packed_training_with_the_configs_cache_builds_no_document_mask(tmp_path):
    """Written blind as a correct program (quiet-zn): DataCollatorWithFlattening's restarting position_ids, no
    attention_mask, a training call that passes no use_cache. The config's use_cache=True makes a cache inside the
    forward and transformers' masking_utils reads packed documents only where no cache is in play: that step attends
    across the examples. The finding says why; --fixed (use_cache=False) is quiet."""
    pytest.importorskip("transformers")
    flagged = check_bug(tmp_path, "hf_flattened_packing_trained_with_the_configs_cache", "documents-leak", ARGS)
    starts = [0] * 7 + [1] * 12 + [2] * 5  # (the examples of 7, 12 and 5 tokens the program packs)
    want = first((1, 24, 24), lambda b, q, k: k <= q and starts[q] != starts[k])
    assert tuple(flagged[0]["cell"]) == want == (0, 7, 0)
    assert "this model's config says use_cache=True, which the call did not turn off" in flagged[0]["message"]


def test_multicenter_sepsis_layers_called_without_the_mask_they_built(tmp_path):
    """BorgwardtLab/multicenter-sepsis 7574e45 (written blind, batch blind-ha; caught before any rule was changed for
    it): AttentionModel built its padding mask from the stays' lengths and called every encoder layer without it, so
    an hour's score saw the padding of shorter stays (and later hours). Its fix quiet: its per-instance loss
    `loss.sum(-1) / (L - invalid.sum(-1))` divides by the count of valid hours (trace/maskmean.py follows `L - count` as
    the mask's complement), and its hourly 0/1 labels padded with NaN are no input padded with zeros (trace/padend.py)."""
    [hit] = check_bug(tmp_path, "multicenter_sepsis_attention_model_online_scores_see_future_and_padding",
                      "padding-ignored")[:1]
    assert "batch row 1: query 0 sees key 4" in hit["message"]


@pytest.mark.parametrize("name", [
    # stanfordnlp/stanza 766643aa (written blind, blind-ix, round 60): extract_bert_embeddings pads the batch and hands
    # BertModel no attention_mask; caught before tuning
    "stanza_bert_embedding_padded_batch_no_attention_mask",
    # FGA-DIKU/BONSAI#164 (9e2de21; written blind, blind-jb, round 60): CorebehrtEncoder hands ModernBert
    # `torch.ones_like(batch["concept"])`; caught before tuning
    "corebehrt_encoder_attention_mask_all_ones_attends_padding",
])
def test_encoders_handed_no_padding_mask_over_padded_batches_are_flagged_and_their_fixes_are_not(tmp_path, name):
    pytest.importorskip("transformers")
    check_bug(tmp_path, name, "padding-ignored")


def test_counts_on_against_a_loop():
    """counts_on: a row counts on from a restart where some token after the first sits at 0 and the next at 1, then 2 or
    the row's end (a packed document); GraphCodeBERT's data-flow nodes at 0 between code at 2, 3, ... and pads at 1 do
    not."""
    from maskcli.checks.arguments import counts_on

    rng = np.random.default_rng(0)
    rows = [np.array([2, 3, 4, 5, 0, 0, 0, 1, 1]), np.array([0, 1, 2, 3, 0, 1, 2, 0, 0]),
            np.array([0, 1, 2, 3, 4, 5, 6, 0, 1])]
    rows += [rng.integers(0, 4, size=9) for _ in range(200)]
    positions = np.stack(rows)
    loop = [any(row[i] == 0 and row[i + 1] == 1 and (i + 2 == len(row) or row[i + 2] == 2) for i in range(1, len(row) - 1))
            for row in rows]
    assert counts_on(positions)[:, 0].tolist() == loop and loop[:3] == [False, True, True]


@pytest.mark.parametrize("name", [
    # huggingface/optimum-habana#623 (d1e66b9aa; written blind, blind-kh, round 61; caught before tuning): the fused
    # SDPA prefill handed no mask and is_causal=True over a left-padded batch
    "optimum_habana_llama_fused_sdpa_prefill_padded_batch",
    # huggingface/optimum-habana#1556 (90c9cbda5): GaudiGemmaModel built its 4-D mask only when handed one; lm_eval's
    # adapter hands none, so padded requests attend both ways and their pads
    "optimum_habana_gemma_lm_eval_no_attention_mask_no_causal",
])
def test_optimum_habana_paths_that_drop_the_padding_are_flagged_and_their_fixes_are_not(tmp_path, name):
    check_bug(tmp_path, name, "padding-ignored")


def test_simpletransformers_representation_model_attention_mask_not_passed(tmp_path):
    """ThilinaRajapakse/simpletransformers 53933d2 (written blind, batch blind-fy, caught before any rule was changed
    for it): RepresentationModel._tokenize padded the batch and kept only input_ids, so BERT saw no attention mask."""
    name = "simpletransformers_representation_model_attention_mask_not_passed"
    status, found, report = traced(tmp_path, name, False)
    assert status == 1 and [f for f in found if f["code"] == "padding-ignored" and f["severity"] == "wrong"], report
    # the fix hands the mask; its `combine_strategy="mean"` still pools `torch.mean(token_vectors, dim=1)` over every
    # position, the second sentence's 11 pads among them (true of the upstream mean_across_all_tokens at the fix)
    status, found, report = traced(tmp_path, name, True)
    wrong = [f for f in found if f["severity"] == "wrong"]
    assert [f["code"] for f in wrong] == ["mean-over-padding"], report
    assert "batch row 1: a mean over axis 1 of a (3, 16, 32) tensor averages all 16 positions" in \
        " ".join(wrong[0]["message"].split()), report


def test_tunix_gemma4_splash_kernel_run_one_sample_at_a_time_without_its_segment_ids(tmp_path):
    # google/tunix e31e280e (written blind, blind-lk, round 66; caught before tuning, but its fix was then a false
    # alarm: each vmapped sample's (heads, L, L) call was read as queries L.. of a (B L) stream and as the batch folded
    # with its heads, so sample 1's window was judged by sample 0's padding): Gemma4.__call__ dropped the segment ids
    # the RL log-prob path hands it, so the completions of a left-padded row attended the prompt's pad tokens
    found = check_bug(tmp_path, "tunix_gemma4_splash_attention_drops_rl_segment_ids", "padding-ignored")
    prompt, completion = [0, 0, 0, 0, 0, 11, 12, 13], [31, 32, 33, 34, 1, 0]
    real = [t != 0 for t in prompt + completion]  # sample 0's; sample 1 has no padding
    b, q, k = found[0]["cell"]
    assert (q, k) == first((1, 14, 14), lambda _, q, k: real[q] and not real[k] and q - 4 < k <= q)[1:]
    assert "rows 0..3 of the 8" in found[0]["message"]  # (sample 0's 4 heads, of the batch of 2 folded with them)


def test_a_loop_handing_sdpa_one_samples_heads_is_read_against_that_samples_padding(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "per_sample_loop_heads_key_padding_dropped", ("padding-ignored",))
    ids = [[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13]]
    expected = first((1, 6, 6), lambda _, q, k: k <= q and ids[0][q] != 0 and ids[0][k] == 0)
    assert tuple(hit["cell"]) == expected and "sample 0 of the batch of 2" in hit["message"]


def test_kospeech_mask_repeated_batch_major_over_head_major_scores(tmp_path):
    # sooftware/kospeech b4c3b3f5 (written blind, blind-lh, round 66; missed before: the scores' rows, a (H, B, ..)
    # query viewed H * B, were read only "either way round", and the mask kept to one of the two): the (B, Q, K) mask
    # repeated batch-major (`unsqueeze(1).repeat(1, H, 1, 1)`) over scores folded head-major (`permute(2, 0, 1, 3)`)
    found = check_bug(tmp_path, "kospeech_speech_transformer_mha_mask_repeated_batch_major", "padding-ignored")
    lengths, heads = [12, 7], 4  # the encoder's frames per utterance

    def bad(r, q, k):  # row r is utterance r % 2; its mask is utterance r // 4's
        return q < lengths[r % 2] and lengths[r % 2] <= k < lengths[r // heads]

    assert tuple(found[0]["cell"]) == first((8, 12, 12), bad) and "head-major" in found[0]["message"]


def test_a_key_padding_repeated_per_sample_over_scores_folded_heads_first_is_found(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "heads_first_fold_padding_repeated_per_sample", ("padding-ignored",))
    lengths, heads = [7, 4, 5], 4
    expected = first((12, 7, 7), lambda r, q, k: q < lengths[r % 3] and lengths[r % 3] <= k < lengths[r // heads])
    assert tuple(hit["cell"]) == expected and "head-major" in hit["message"]


def test_ptls_transformer_seq_encoder_causal_mask_transposed_over_a_padded_batch(tmp_path):
    # pytorch-lifestream c4058261 (written blind, blind-ku; missed until now: the batch's lengths were held by its PaddedBatch
    # argument, `seq_lens`, never by name): `generate_square_subsequent_mask(...).t()` let each transaction see the
    # later ones and the row's trailing padding
    found = check_bug(tmp_path, "ptls_transformer_seq_encoder_after_mask_transposed", "padding-ignored")
    assert "a causal mask transposed?" in found[0]["message"] and "the lengths given to Sequential" in found[0]["message"]


def test_a_batch_objects_lengths_state_the_padding_a_transposed_causal_mask_shows(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "batch_object_lengths_causal_mask_transposed", ("padding-ignored",))
    lengths = (7, 4)
    expected = first((2, 7, 7), lambda b, q, k: q < lengths[b] and k >= q and k >= lengths[b])
    assert tuple(hit["cell"]) == expected and "a causal mask transposed?" in hit["message"]


def test_object_queries_as_many_as_the_text_tokens_are_not_read_against_its_padding(tmp_path):
    """SAM3's DETR decoder (written blind, quiet-r76b, a false alarm): its object queries self-attend, then cross-attend
    a memory of the text prompt joined before the box prompts; the text's attention_mask counted as many tokens as
    there were object queries, and the queries' self-attention was read against it. The memory's keys begin with the
    text: that padding is the memory's. Written another way (tests/data/quiet): 6 object queries, a 6-token text
    joined with 2 box tokens. Quiet, and every sample matches its text alone."""
    status, found, report = traced(tmp_path, "object_queries_over_text_then_box_prompts", False, QUIET)
    assert status == 0 and not [f for f in found if f["code"] == "padding-ignored"], report
    assert "every sample matches its text alone" in report


def test_torchtextclassifiers_label_attention_never_handed_the_mask(tmp_path):
    """InseeFrLab/torchTextClassifiers 49caf94 (written blind, blind-pz, caught before tuning): TextEmbedder calls its
    LabelAttentionClassifier without the attention_mask, so each label's query attends the pads of the shorter texts
    (right-padded, pad id 0); the fix passes `attention_mask == 1` as a (B, 1, 1, T) bool mask. Row 2 (3 real tokens
    of 8) is the one the finding names first: its pad 5 seen."""
    [hit, *_] = check_bug(tmp_path, "torchtextclassifiers_label_attention_mask_never_passed", "padding-ignored")
    assert hit["cell"][0] == 2 and hit["cell"][2] >= 3, hit


def test_transformers_token_classification_pipeline_batched_without_an_attention_mask(tmp_path):
    """huggingface/transformers#16222 (fixes #16221; written blind, blind-qn, caught before any rule changed for it):
    TokenClassificationPipeline.preprocess asked the tokenizer for return_attention_mask=False, so a batch of two
    sentences padded with id 0 reached BERT with no mask: the short sentence's query 0 sees its first pad, key 7."""
    [hit] = check_bug(tmp_path, "transformers_token_classification_pipeline_batch_without_attention_mask",
                      "padding-ignored")
    assert tuple(hit["cell"]) == (0, 0, 7) and "pad id 0" in hit["message"], hit


def test_hopsparser_bert_lexer_hands_bert_the_ids_alone(tmp_path):
    """hopsparser 4e6e5c4 (written blind, blind-to; missed before tuning): BertLexer.forward is handed a NamedTuple
    batch whose `encoding` is the tokenizer's BatchEncoding, and runs BERT on its input_ids alone. The batch object the
    outermost call was handed states the padding (trace/padded.py reads the one tokenizer output it holds), so the
    real queries that see the pads are padding-ignored. The fix hands BERT the mask. Both runs average the root word
    over every subword, pads too (mean-over-padding: true of hopsparser as written, fix included)."""
    name = "hopsparser_bert_lexer_padded_batch_without_attention_mask"
    status, found, report = traced(tmp_path, name, False, BLIND)
    lengths = [6, 20]  # (the short sentence's wordpieces and the batch's padded width)
    hit = next(f for f in found if f["code"] == "padding-ignored")
    assert tuple(hit["cell"])[:3] == (0, 0, lengths[0]) and "the attention_mask given to BertLexer" in hit["message"]
    status, found, report = traced(tmp_path, name, True, BLIND)
    assert sorted({f["code"] for f in found if f["severity"] == "wrong"}) == ["mean-over-padding"], report


def test_a_dataclass_batch_whose_encoders_mask_is_left_behind_is_found(tmp_path):
    """Written another way: a tagger's dataclass batch holds the tokenizer's dict (`encoding`) beside the labels;
    nn.TransformerEncoder runs on its input_ids with no src_key_padding_mask. Reference: the first real query of the
    first padded row and its first pad key, from the collated lengths."""
    found = check_bug(tmp_path, "dataclass_batch_encoding_mask_left_behind", "padding-ignored", ARGS)
    lengths, width = [6, 3, 4], 6
    row = next(b for b, n in enumerate(lengths) if n < width)
    hit = next(f for f in found if f["code"] == "padding-ignored")
    assert tuple(hit["cell"])[:3] == (row, 0, lengths[row]) and "given to Tagger" in hit["message"]


def test_paddlenlp_ernie_m_builds_its_default_mask_from_id_zero_not_its_pad_id(tmp_path):
    """PaddlePaddle/PaddleNLP#4494 (written blind, blind-uf, caught before any rule changed for it): handed no mask,
    ErnieMModel masked `input_ids == 0` while ERNIE-M pads with 1, so the right-padded row's pads were attended. The
    program's `pad_token_id=1` states the padding; the fix masks it. Row 1 (5 real tokens) sees its first pad."""
    found = check_bug(tmp_path, "paddlenlp_ernie_m_default_mask_from_token_zero_not_pad", "padding-ignored")
    assert tuple(found[0]["cell"])[:3] == (1, 0, 5) and "pad id 1 of pad_token_id=1" in " ".join(
        found[0]["message"].split())


def test_r1v_grpo_log_probs_over_left_padded_prompts_with_no_attention_mask(tmp_path):
    """Deep-Agent/R1-V#32 (fixed by 5715c29; written blind, blind-up, caught before any rule changed for it): the GRPO
    trainer recomputed the per-token log-probs with `model(input_ids)`, no attention_mask, so the left pads of the
    shorter prompt were attended (padding-ignored at row 1, the 4-token prompt padded to 6). The fix hands
    cat([prompt_mask, completion_mask]) but repeats the prompt mask with repeat_interleave while the ids were
    concatenated generation by generation: rows 1 and 2 swap prompt masks, so row 2's first real tokens are masked
    (real-tokens-masked: true of the fix as written, upstream's too)."""
    status, found, report = traced(tmp_path, "r1v_qwen2vl_grpo_logps_left_padded_prompts_no_attention_mask", False)
    said = [f for f in found if f["code"] == "padding-ignored"]
    assert status == 1 and said and said[0]["severity"] == "wrong" and "batch row 1: query 6 sees key 0" in \
        " ".join(said[0]["message"].split()), report
    status, found, report = traced(tmp_path, "r1v_qwen2vl_grpo_logps_left_padded_prompts_no_attention_mask", True)
    wrong = {f["code"] for f in found if f["severity"] == "wrong"}
    said = [f for f in found if f["code"] == "real-tokens-masked"]
    assert wrong == {"real-tokens-masked"} and "batch row 2: query 0 does not see key 0" in \
        " ".join(said[0]["message"].split()), report
