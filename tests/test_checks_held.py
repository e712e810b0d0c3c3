"""checks/held.py (and trace/held.py, which records what it reads): the padding and chunk masks the program's own
frames hold at an attention call, against the mask the kernel applied."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug, first, traced

HELD = Path(__file__).parent / "data" / "held"
BLIND = Path(__file__).parent / "data" / "blind"
QUIET = Path(__file__).parent / "data" / "quiet"


def test_axolotl_bidirectional_mask_ignores_padding(tmp_path):
    """axolotl#3735: the 4D all-ones mask handed to the model while the loss step holds the batch's attention_mask."""
    check_bug(tmp_path, "axolotl_diffusion_bidirectional_mask_ignores_padding", "padding-unused")


def test_e2_tts_transformer_self_attention_ignores_lens_mask(tmp_path):
    """lucidrains/e2-tts-pytorch 58288b2 (written blind, batch blind-cw; caught before any rule was changed for it):
    Transformer.forward holds `mask` (lens_to_mask) and calls attn(attn_norm(x)) without it."""
    found = check_bug(tmp_path, "e2_tts_transformer_self_attention_ignores_lens_mask", "padding-unused")
    lens = (20, 11)  # (the program's lens: batch row 1 is right-padded after 11 frames)
    assert tuple(found[0]["cell"]) == first((2, 20, 20), lambda b, q, k: q < lens[b] and k >= lens[b])


def test_allennlp_bert_embedder_mask_handed_as_token_types(tmp_path):
    """allenai/allennlp#2145 (written blind, batch blind-fy; caught before any rule was changed for it): BertEmbedder
    handed (input_ids, input_mask, token_type_ids) by position to a BertModel that takes (input_ids, token_type_ids,
    attention_mask), so the all-zero token types were the mask: every key -10000 alike, the padding seen."""
    found = check_bug(tmp_path, "allennlp_bert_embedder_mask_passed_as_token_type_ids", "padding-unused")
    lens = (9, 5, 3)  # (the program's wordpieces: [CLS] 7 words [SEP], [CLS] 3 words [SEP], [CLS] 1 word [SEP])
    assert tuple(found[0]["cell"]) == first((3, 9, 9), lambda b, q, k: q < lens[b] and k >= lens[b])


def test_a_conformer_style_lengths_held_and_never_made_a_mask(tmp_path):
    """Written another way: a left-padded batch, its `src_lengths` held by the encoder, nn.MultiheadAttention called
    with no key_padding_mask."""
    found = check_bug(tmp_path, "encoder_src_lengths_never_made_key_padding", "padding-unused", folder=HELD)
    lengths = (5, 8)  # (lengths say no side: the first cell of either reading, right- or left-padded)
    right = first((2, 8, 8), lambda b, q, k: q < lengths[b] <= k)
    left = first((2, 8, 8), lambda b, q, k: k < 8 - lengths[b] <= q)
    assert tuple(found[0]["cell"]) in (right, left)


def test_speechbrain_decode_no_memory_padding_mask(tmp_path):
    """speechbrain#1107: the searcher holds the encoder lengths; the decoder's cross-attention never gets them (either
    way the lengths may lie, right- or left-padded, its queries see padded memory)."""
    check_bug(tmp_path, "speechbrain_transformer_asr_decode_no_memory_padding_mask", "padding-unused")


def test_opentau_temporal_attention_padded_history(tmp_path):
    """OpenTau#254: `obs_history_is_pad` (B, T) held while the (B * patches, T, T) temporal attention is plain causal:
    the folded batch read either way round."""
    check_bug(tmp_path, "opentau_spacetime_video_temporal_attn_padded_history", "padding-unused")


def test_mist_bool_key_padding_added_to_scores(tmp_path):
    """DiffMS#25: the bool key padding mask added (+1.0) to the scores instead of the -inf mask built beside it."""
    check_bug(tmp_path, "mist_peak_attention_bool_key_padding_added_to_scores", "padding-unused")


def test_alphafold2_pair_mask_sum_of_bool_masks(tmp_path):
    """alphafold2 dda22b5: the pair mask `mask_i + mask_j` (OR) handed to the (b i) j axial attention, which keeps to
    it; the residue mask main() holds says the padded residues' pairs are padding. The fix's fully padded pair rows
    (a finite fill, max subtracted: every key seen) are padded rows, not real queries seeing padding."""
    check_bug(tmp_path, "alphafold2_pair_mask_sum_of_bool_masks", "padding-unused")


def test_sentence_transformers_signature_filter_drops_attention_mask(tmp_path):
    # huggingface/sentence-transformers#3509 (commit 560cc336): Transformer.forward kept only the features
    # inspect.signature(auto_model.forward) names; a forward(self, input_ids, **kwargs) model lost attention_mask
    found = check_bug(tmp_path, "sentence_transformers_transformer_forward_drops_attention_mask_for_kwargs_model",
                      "padding-unused")
    lengths = (10, 4)  # right-padded to 10 with id 0; features["attention_mask"] says so
    assert tuple(found[0]["cell"]) == first((2, 10, 10), lambda b, q, k: q < lengths[b] <= k)
    assert "(24 such cells)" in found[0]["message"]


def test_signature_filtered_kwargs_drops_key_padding(tmp_path):
    """sentence-transformers#3509 written another way: plain torch, left padding, True = padding, SDPA; the backbone
    reads `extra.get("pad_mask")`, which the signature filter dropped; the first cell is a double loop's."""
    found = check_bug(tmp_path, "signature_filtered_kwargs_drops_key_padding", "padding-unused", folder=HELD)
    pads = (3, 0, 2)  # left pads of the rows [3, 6, 4 tokens] in 6
    assert tuple(found[0]["cell"]) == first((3, 6, 6), lambda b, q, k: q >= pads[b] > k)
    assert "(17 such cells)" in found[0]["message"]


def test_pair_padding_and_of_pads(tmp_path):
    """Written another way: True = padding, `pad_i & pad_j` folded (b j) i into SDPA's key padding; the first cell is a
    double loop's over the residues' padding (a real column's real query that sees a padded residue)."""
    status, found, report = traced(tmp_path, "pair_padding_and_of_pads", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-unused")
    assert hit["severity"] == "wrong"
    lengths = [5, 3]
    assert tuple(hit["cell"]) == first(
        (10, 5, 5), lambda r, q, k: q < lengths[r // 5] and r % 5 < lengths[r // 5] <= k)
    status, found, report = traced(tmp_path, "pair_padding_and_of_pads", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_padding_mask_never_passed(tmp_path):
    """Written another way: left-padded, True = padding, nn.MultiheadAttention; the first cell is a double loop's over
    the stated padding (real queries, padded keys: the call masks nothing)."""
    status, found, report = traced(tmp_path, "padding_mask_never_passed", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-unused")
    assert hit["severity"] == "wrong"
    pad = [[1, 1, 1, 0, 0], [0] * 5, [1, 0, 0, 0, 0]]
    assert tuple(hit["cell"]) == first((3, 5, 5), lambda b, q, k: not pad[b][q] and bool(pad[b][k]))
    status, found, report = traced(tmp_path, "padding_mask_never_passed", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_espnet_chunk_mask_and_source_mask(tmp_path):
    """espnet#4751: chunk mask and padding (both True = masked) combined with AND: later chunks visible."""
    check_bug(tmp_path, "espnet_transducer_chunk_mask_and_source_mask", "held-mask-ignored")


def test_chunk_masks_dropped(tmp_path):
    """Written another way: WeNet's polarity (True = may attend), (B, T, T), SDPA handed only the padding."""
    import torch

    status, found, report = traced(tmp_path, "chunk_masks_dropped", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "held-mask-ignored")
    chunk = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        chunk[i, : (i // 2 + 1) * 2] = True
    lengths = [6, 5]
    # the kernel's mask: the padding only; the cells it sees that the chunk mask hides, fewest first (row 0 has more)
    bad = [[[k < lengths[b] and not chunk[q, k] for k in range(6)] for q in range(6)] for b in range(2)]
    assert sum(map(sum, bad[1])) < sum(map(sum, bad[0]))
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: b == 1 and bad[b][q][k])
    status, found, report = traced(tmp_path, "chunk_masks_dropped", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_readings_against_double_loop():
    """Lengths read both ways, a folded batch both ways, against masks built by a double loop; what is not padding
    (no row all real, a plain `mask` left-padded, a masked-LM choice) is not read."""
    from maskcli.checks.held import readings

    lengths = np.array([4, 2])
    got = readings({"kind": "lengths", "rows": lengths, "name": "x_lens"}, 2, 4)
    right = [[k < n for k in range(4)] for n in lengths]
    left = [[k >= 4 - n for k in range(4)] for n in lengths]
    assert [r.tolist() for r in got] == [right, left]
    folded = readings({"kind": "pad", "rows": np.array([[True, False], [False, False]]), "name": "is_pad"}, 6, 2)
    interleaved = [[not (r // 3 == 0 and k == 0) for k in range(2)] for r in range(6)]
    tiled = [[not (r % 2 == 0 and k == 0) for k in range(2)] for r in range(6)]
    assert [r.tolist() for r in folded] == [interleaved, tiled]
    left_mask = np.array([[0, 1, 1], [1, 1, 1]])
    assert readings({"kind": "keep", "rows": left_mask, "name": "mask"}, 2, 3) == []  # (a loss mask's shape)
    assert len(readings({"kind": "keep", "rows": left_mask, "name": "attention_mask"}, 2, 3)) == 1
    assert readings({"kind": "keep", "rows": np.array([[1, 1, 0], [1, 0, 0]]), "name": "attention_mask"}, 2, 3) == []
    assert readings({"kind": "keep", "rows": np.array([[1, 0, 1], [1, 1, 1]]), "name": "attention_mask"}, 2, 3) == []


def test_frames_read_by_name(monkeypatch):
    """trace/held.py reads the tensors a function of the program holds under a padding mask's name, each polarity by
    its name, and leaves others (a float mask of weights, a 3-D tensor under a padding name) alone."""
    import torch

    from maskcli.trace import held

    monkeypatch.setattr(held, "_SKIP", ("/nonexistent",))  # (this test's own file is a program's here)

    def inner():
        attention_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        src_key_padding_mask = torch.tensor([[False, True, True], [False, False, False]])
        enc_lens = torch.tensor([3, 1])
        p_mask = torch.rand(2, 3)  # noqa: F841 - not a name of padding
        input_mask = torch.rand(2, 3)  # noqa: F841 - a name of padding, but not 0/1
        return held.padding()

    found = {one["name"]: one for one in inner()}
    assert set(found) == {"attention_mask", "src_key_padding_mask", "enc_lens"}
    assert found["attention_mask"]["kind"] == "keep" and found["src_key_padding_mask"]["kind"] == "pad"
    assert found["enc_lens"]["kind"] == "lengths" and found["enc_lens"]["rows"].tolist() == [3, 1]


def test_megatron_window_drops_packed_mask(tmp_path):
    """NVIDIA/Megatron-LM#7039: the sliding-window branch replaces the caller's packed-document mask (True = masked).
    The bool `mask` is a parameter of the function that attends, so the same cells are said by mask-argument-dropped
    (that mask read either way round), which leaves held-mask-ignored out of the group (engine.SAID_BY)."""
    check_bug(tmp_path, "megatron_fused_softmax_window_drops_packed_mask", "mask-argument-dropped")


def test_window_replaces_document_mask(tmp_path):
    """Written another way: the other polarity (True = may attend), SDPA; the first cell is a double loop's over what
    the kernel's window sees outside the documents' mask."""
    status, found, report = traced(tmp_path, "window_replaces_document_mask", False, HELD)
    assert status == 1, report
    # (the bool attention_mask is forward()'s own parameter: said by mask-argument-dropped, read either way round,
    # which leaves held-mask-ignored out of the group: engine.SAID_BY)
    hit = next(f for f in found if f["code"] in ("held-mask-ignored", "mask-argument-dropped") and f["severity"] == "wrong")
    doc = [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]]
    sees = lambda b, q, k: k <= q and q - k < 3 and doc[b][q] != doc[b][k]  # noqa: E731 - the window sees another document
    assert tuple(hit["cell"]) == first((2, 7, 7), sees)
    status, found, report = traced(tmp_path, "window_replaces_document_mask", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_torchtitan_packed_documents_from_missing_eos_in_its_own_process(tmp_path):
    """pytorch/torchtitan#3130: documents split on an EOS the packed SFT inputs dropped, while the packing loop's
    positions restart at 0 for each conversation. Traced in a process of its own (flex_attention: dynamo's guards on
    the program's __main__ would break later traces in this process)."""
    import json
    import subprocess
    import sys

    program = Path(__file__).parent / "data" / "bugs" / "torchtitan_sft_packed_document_mask_from_missing_eos.py"
    for fixed in (False, True):
        out = tmp_path / f"t{int(fixed)}.json"
        done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program),
                               *(["--fixed"] if fixed else [])], capture_output=True, text=True, timeout=600)
        data = json.loads(out.read_text())
        wrong = [f["code"] for g in data["groups"] for f in g["findings"] if f["severity"] == "wrong"]
        assert data["exit_status"] == 0, done.stderr
        assert (done.returncode, "held-documents-leak" in wrong) == ((0, False) if fixed else (1, True)), done.stderr
        assert not fixed or wrong == [], done.stderr


def test_packed_positions_kept_by_collator(tmp_path):
    """Written another way: `position_ids` from a collator, SDPA's is_causal; the first cell is a double loop's over
    the documents the positions mark (a new one at each 0 after a later position; the zeros of padding left out)."""
    import torch

    status, found, report = traced(tmp_path, "packed_positions_kept_by_collator", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "held-documents-leak")
    positions = [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 0, 1, 0, 1, 2]]
    doc = [[sum(1 for j in range(1, i + 1) if row[j] == 0 and row[j - 1] > 0) for i in range(8)] for row in positions]
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    assert tuple(hit["cell"]) == first((2, 8, 8), lambda b, q, k: bool(causal[q, k]) and doc[b][q] != doc[b][k])
    status, found, report = traced(tmp_path, "packed_positions_kept_by_collator", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_musubi_joint_attention_ignores_text_mask(tmp_path):
    """kohya-ss/musubi-tuner#686: the joint image + text attention never gets the text padding; the program's own
    `total_len = seq_img + txt_seq_lens` (each sample's real joint length) is read both ways round, and seen through
    both ways."""
    check_bug(tmp_path, "musubi_qwen_image_joint_attention_ignores_text_mask", "padding-unused")


def test_padding_multiplied_in_after_the_softmax_is_kept(tmp_path):
    """AllenNLP's masked_softmax: softmax over every key, then times the padding mask and renormalised. The padded
    keys get weight 0, so the program's padding is kept: no padding-unused, and the call's mask is that padding."""
    status, found, report = traced(tmp_path, "allennlp_masked_softmax", False, QUIET)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report
    assert "padding (--lengths 6,4)" in report


def test_a_mask_built_for_another_call_is_not_this_calls(tmp_path):
    """An encoder-decoder's forward() builds the decoder's causal `mask` (1, 1, L, L) before it runs the encoder, whose
    attention is handed the padding alone: `mask` is no function's argument on the way to the encoder's kernel, so no
    held-mask-ignored there; the decoder is handed it and keeps to it (torch.tril)."""
    status, found, report = traced(tmp_path, "held_causal_for_decoder", False, QUIET)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report
    assert "padding (--lengths 6,4)" in report and " causal\n" in report


def test_a_decoders_lengths_at_its_cross_attention_are_not_the_memorys(tmp_path):
    """A cross-attention (module path `CrossAttention`) with as many queries as keys and the decoder's `lengths` held:
    they may be the queries' padding, which no key mask need keep to (nn.MultiheadAttention's key_padding_mask pads
    keys only), so no padding-unused on an unpadded memory."""
    status, found, report = traced(tmp_path, "decoder_lengths_at_cross_attention", False, QUIET)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report


def test_a_left_pad_mask_made_an_outer_product_is_read_by_its_diagonal(tmp_path):
    """RVC-Boss/GPT-SoVITS#2153: `padding_mask.unsqueeze(1) * padding_mask.unsqueeze(2)` (True = padding) hides only
    pad-to-pad cells, so real tokens attend the left padding; each token's own cell of the (B, L, L) mask named as
    padding says which tokens are padding. The fix repeats the key mask over the queries (the same diagonal)."""
    found = check_bug(tmp_path, "gpt_sovits_batch_infer_left_pad_mask_product", "padding-unused")
    pads = (0, 3)  # text lengths 6 and 3 left-padded to 6, then 2 prompt tokens: 8 keys
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: q >= pads[b] and k < pads[b])
    assert "(15 such cells)" in found[0]["message"] and "padding_mask in infer_panel_batch_infer()" in found[0]["message"]


def test_a_pad_mask_laid_over_the_query_rows_is_read_by_its_diagonal(tmp_path):
    """Written another way: a right-padded encoder's (B, L, L) `src_pad_mask` laid over the query rows (True = padding),
    so the real queries see the padding keys; its fix lays it over the key columns."""
    found = check_bug(tmp_path, "encoder_pad_mask_over_query_rows", "padding-unused", folder=HELD)
    lengths = (6, 3, 4)
    assert tuple(found[0]["cell"]) == first((3, 6, 6), lambda b, q, k: q < lengths[b] and k >= lengths[b])
    assert "(17 such cells)" in found[0]["message"]


def test_a_square_mask_named_padding_is_read_by_its_diagonal_only_when_it_is_padding():
    import torch

    from maskcli.trace.held import _as_padding

    pad = torch.tensor([[False, False, False], [False, True, True]])
    product = pad[:, :, None] & pad[:, None, :]
    keys = pad[:, None, :].expand(2, 3, 3)
    for laid in (product, keys, pad[:, :, None] | pad[:, None, :]):
        assert _as_padding("padding_mask", laid)["rows"].tolist() == pad.tolist()
    assert _as_padding("scores", product) is None  # not named as padding
    assert _as_padding("padding_mask", torch.rand(2, 3, 3)) is None  # not 0/1

def test_a_perceivers_latents_are_not_read_against_the_frames_padding_it_holds(tmp_path):
    """The Perceiver of tests/data/quiet with its frames' padding held only as a `mask` (no attention_mask argument):
    the latents' self-attention, as long as the frames, is not read against it (the cross-attention beside it hides
    exactly those frames): quiet. With that cross-attention's mask dropped, the padding held is unused: found, at the
    first padded frame a real latent sees by a loop."""
    source = (QUIET / "perceiver_latents_as_many_as_frames.py").read_text().replace("attention_mask", "frames_valid")
    (tmp_path / "held_frames.py").write_text(source)
    status, found, report = traced(tmp_path, "held_frames", False, tmp_path)
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report
    dropped = source.replace("cross_attn(x, context=data, mask=mask)", "cross_attn(x, context=data)")
    assert dropped != source
    (tmp_path / "held_frames_dropped.py").write_text(dropped)
    status, found, report = traced(tmp_path, "held_frames_dropped", False, tmp_path)
    hit = next(f for f in found if f["code"] == "padding-unused")
    real = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=bool)
    assert status == 1 and tuple(hit["cell"]) == first((2, 4, 4), lambda b, q, k: not real[b, k]), report


def test_a_keep_mask_filled_where_it_is_true_in_a_cross_attention_is_found(tmp_path):
    # neuro-galaxy/torch_brain#74: masked_fill(attn_mask, -inf) on a True = attend mask; main() holds `input_mask`
    found = check_bug(tmp_path, "torch_brain_rotary_xformers_attn_bias_inverted", "padding-only-attended")
    lengths = (6, 5)  # of 7 tokens each, right-padded: neither row is whole (a batch padded to a bucket)
    assert tuple(found[0]["cell"]) == first((2, 4, 7), lambda b, q, k: q == 0 and k >= lengths[b])
    assert "input_mask in main() of" in found[0]["message"] and "keys [6] only" in found[0]["message"]


def test_a_padding_mask_turned_round_for_multihead_attention_on_a_left_padded_dict_batch_is_found(tmp_path):
    found = check_bug(tmp_path, "mha_key_padding_mask_turned_round_left", "padding-only-attended", folder=HELD)
    pads = (3, 1, 2)  # left padding of rows of 3, 5 and 4 in 6
    assert tuple(found[0]["cell"]) == first((3, 6, 6), lambda b, q, k: q == 0 and k < pads[b])
    assert "padding_mask in forward() of" in found[0]["message"] and "keys [0, 1, 2] only" in found[0]["message"]


def test_star_transformer_relay_attends_the_padding_beside_its_own_key(tmp_path):
    """fastNLP#138: the relay node's keys are [relay, tokens]; `mask` (1 = token) covers the tokens only and is used
    as masked_fill's mask: row 1 (4 real of 6) sees the relay and its 2 padding tokens only."""
    [hit] = check_bug(tmp_path, "fastnlp_star_transformer_relay_mask_not_flipped", "padding-only-attended")
    lengths = (6, 4)
    pads = [1 + k for k in range(6) if k >= lengths[1]]  # the padded row's padding keys, after the relay's key 0
    assert tuple(hit["cell"]) == (1, 0, pads[0]) and f"keys {pads} only" in hit["message"]
    assert "(keys 1-6 of 7: its tokens)" in hit["message"]


def test_a_pad_mask_handed_to_sdpa_as_keep_with_a_summary_key_after_the_tokens(tmp_path):
    """Written another way: the extra key after the tokens, `pad_mask` (True = padding) made SDPA's keep mask."""
    [hit] = check_bug(tmp_path, "pooling_cls_appended_pad_mask_as_keep", "padding-only-attended", folder=HELD)
    lengths = (5, 3, 2)
    assert tuple(hit["cell"]) == first((3, 6, 5), lambda b, q, k: lengths[b] < 5 and q == 0 and k >= lengths[b])
    assert "keys [3, 4] only" in hit["message"] and "(keys 0-4 of 6: its tokens)" in hit["message"]


def test_funnel_rel_attention_subtracting_the_keep_mask_as_if_one_meant_masked(tmp_path):
    """huggingface/transformers#7374 (fixes #7371; written blind): FunnelRelMultiheadAttention subtracts
    `INF * attention_mask` (1 = token): the padded row sees its padding only, in the full block (16 queries) and in
    the pooled one (8 queries over 16 keys)."""
    pytest.importorskip("transformers")
    found = check_bug(tmp_path, "transformers_funnel_rel_attention_padding_mask_polarity_inverted",
                      "padding-only-attended")
    lengths = (12, 16)  # right-padded to 16
    assert len(found) == 2
    for hit, queries in zip(found, (16, 8)):
        assert tuple(hit["cell"]) == first((2, queries, 16), lambda b, q, k: k >= lengths[b])
        assert f"keys {list(range(12, 16))} only" in hit["message"]


def test_a_keep_mask_added_as_pad_bias_in_a_pooled_encoder_on_a_left_padded_batch(tmp_path):
    """Written another way (tests/data/held): `attention_mask * -1e4` added to einsum scores, the keep mask min-pooled
    with the states between blocks, left-padded: found in the full block and in the pooled one (its pairs holding
    padding are padding)."""
    found = check_bug(tmp_path, "pooled_encoder_keep_mask_added_as_pad_bias", "padding-only-attended", folder=HELD)
    pads = (0, 3, 2)  # of 8
    pooled = tuple(-(-p // 2) for p in pads)  # a pair with a padding token is padding
    assert len(found) == 2
    for hit, n, pad in zip(found, (8, 4), (pads, pooled)):
        assert tuple(hit["cell"]) == first((3, n, n), lambda b, q, k: k < pad[b])
        assert f"batch row 1: keys {list(range(pad[1]))} only" in hit["message"]


def test_a_kernel_keeping_the_padding_and_more_is_not_read_as_turned_round():
    """held_inverted against a double loop: a kernel that sees the padding and one real key is another matter
    (padding-unused's), and one that sees exactly the padding on every query of every padded row is turned round."""
    from types import SimpleNamespace

    from maskcli.checks.context import Run
    from maskcli.checks.held import held_inverted

    real = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=bool)

    def run_of(cells):
        stored = {"form": "bits", "planes": [3, 1], "shape": [3, 1, 2, 4], "bits": np.packbits(cells, axis=-1)}
        call = SimpleNamespace(index=0, where="attn", api="sdpa", step=0, shape=(3, 1, 2, 4), mask="m", stored=stored,
                               details={"held_padding": [{"kind": "keep", "rows": real, "name": "input_mask",
                                                          "where": "main() of x.py"}]})
        return Run(calls=[call])

    turned = np.broadcast_to(~real[:, None, None, :], (3, 1, 2, 4)).copy()
    expected = [(b, k) for b in range(3) for k in range(4) if not real[b].all() and not real[b, k]]
    assert [f.cell for _, f in held_inverted(run_of(turned))] == [(expected[0][0], 0, expected[0][1])]
    more = turned.copy()
    more[2, 0, 1, 0] = True  # row 2's second query also sees a real key
    assert held_inverted(run_of(more)) == []


def test_opennmt_decoder_not_given_context_lengths(tmp_path):
    """OpenNMT-py#486: NMTModel.forward holds `lengths`; the global attention's softmax over the encoder context (it
    masks nothing, so it is read as attention by the memory its layer was handed) is never given them."""
    check_bug(tmp_path, "opennmt_nmtmodel_decoder_not_given_context_lengths", "padding-unused")


def test_luong_attention_memory_lengths_dropped(tmp_path):
    """Written another way: batch-major, `F.softmax` over (B, 1, S) scores against a `memory` argument, `src_lens`;
    the first cell is a double loop's over the lengths (right-padded: every key past a row's length)."""
    status, found, report = traced(tmp_path, "luong_attention_memory_lengths_dropped", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-unused")
    assert hit["severity"] == "wrong"
    lens = [6, 3, 4]
    assert tuple(hit["cell"]) == first((3, 1, 6), lambda b, q, k: k >= lens[b])
    status, found, report = traced(tmp_path, "luong_attention_memory_lengths_dropped", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_speechbrain_lengths_capable_sequential_drops_wav_lens(tmp_path):
    """speechbrain#2986: the container holds the relative `lengths` (row 1: 0.6 of the padded length) but calls the
    wav2vec2 lobe without them, so its attention_mask is None."""
    check_bug(tmp_path, "speechbrain_lengths_capable_sequential_drops_wav_lens", "padding-unused")


def test_relative_lengths_never_masked(tmp_path):
    """Written another way: `feat_lens` relative lengths over 4x-subsampled frames, nn.MultiheadAttention with no key
    padding mask; the first cell is a double loop's over the keys past each row's share, one frame of rounding
    allowed."""
    import math

    status, found, report = traced(tmp_path, "relative_lengths_never_masked", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-unused")
    assert hit["severity"] == "wrong"
    shares = [0.5, 1.0, 0.75]
    assert tuple(hit["cell"]) == first((3, 12, 12), lambda b, q, k: k >= math.ceil(shares[b] * 12) + 1)
    status, found, report = traced(tmp_path, "relative_lengths_never_masked", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_maxtext_tunix_adapter_drops_padding_segment_ids(tmp_path):
    """MaxText#4016: the adapter is handed the trainer's (B, L, L) `attention_mask` (causal & padding) and drops it; the
    model's mask is the causal triangle only. The fix's segment ids let padding see padding: those query rows (their own
    cell hidden in the held mask) are not judged."""
    found = check_bug(tmp_path, "maxtext_tunix_adapter_drops_padding_segment_ids", "held-mask-ignored")
    tokens = [[0, 0, 11, 12, 31, 32, 33, 0], [21, 22, 23, 24, 41, 42, 0, 0]]
    # a real query that sees an earlier padding key (the triangle, and the adapter's mask hiding padding keys)
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: k <= q and tokens[b][q] != 0 and tokens[b][k] == 0)


def test_trainer_cell_mask_not_passed(tmp_path):
    """Written another way: a trainer's function (not a module) holds `attn_mask` (B, L, L), True = hidden, over a
    left-padded batch; a hand-written softmax masks the causal triangle only."""
    status, found, report = traced(tmp_path, "trainer_cell_mask_not_passed", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "held-mask-ignored")
    assert hit["severity"] == "wrong"
    ids = [[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [0, 15, 16, 17, 18, 19]]
    assert tuple(hit["cell"]) == first((3, 6, 6), lambda b, q, k: k <= q and ids[b][q] != 0 and ids[b][k] == 0)
    status, found, report = traced(tmp_path, "trainer_cell_mask_not_passed", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_a_module_owns_weights_where_torch_finds_a_parameter_in_it():
    """trace/crossing.py's _owns_weights (what the cross-attention reading asks of each running module) against
    Module.parameters()."""
    import torch.nn as nn

    from maskcli.trace.crossing import _owns_weights

    no_bias = nn.Linear(2, 2, bias=False)
    empty = nn.Module()
    empty.register_parameter("weight", None)  # (a parameter slot holding None: parameters() skips it)
    deep = nn.Sequential(nn.ReLU(), nn.Sequential(nn.Identity(), nn.Sequential(nn.Linear(2, 2))))
    modules = [nn.ReLU(), nn.Sequential(nn.ReLU(), nn.GELU()), no_bias, empty, deep, nn.MultiheadAttention(4, 2), nn.Module()]
    assert [_owns_weights(m) for m in modules] == [next(m.parameters(), None) is not None for m in modules]
    assert [_owns_weights(m) for m in modules] == [False, False, True, False, True, True, False]


def test_accelerate_context_parallel_hook_drops_sliding_window_mask(tmp_path):
    """accelerate#4177: the context-parallel hook replaces each layer's sliding-window mask with is_causal=True
    (written blind, batch blind-o; caught before any rule was changed for it). The bool `attention_mask` is the
    attention forward()'s own parameter: said by mask-argument-dropped (read either way round, said in the reading
    that keeps each token's own cell), which leaves held-mask-ignored out of the group (engine.SAID_BY)."""
    [hit] = check_bug(tmp_path, "accelerate_context_parallel_hook_drops_sliding_window_mask", "mask-argument-dropped")
    b, q, k = hit["cell"]
    assert q - k >= 4  # (a key the window of 4 hides, which the causal kernel shows)


def test_mlx_vlm_batch_generate_left_padding_dropped(tmp_path):
    """mlx-vlm#1946: batch generate drops the processor's left padding before the caches
    (written blind, batch blind-o; caught before any rule was changed for it)."""
    check_bug(tmp_path, "mlx_vlm_batch_generate_left_padding_dropped", "padding-unused")


def test_vllm_omni_cosyvoice3_dit_streaming_chunk_mask_after_attention(tmp_path):
    """vllm-omni#5704: CosyVoice 3's DiT builds its streaming chunk and padding mask after the attention that needed it
    (written blind, batch blind-p; caught before any rule was changed for it)."""
    check_bug(tmp_path, "vllm_omni_cosyvoice3_dit_streaming_chunk_mask_after_attention", "padding-unused")


def _left_padding_seen(real: list[list[int]]):
    """bad(b, q, k) of a causal mask: a real query sees a key its row's held mask calls padding, by a double loop."""
    return lambda b, q, k: k <= q and real[b][q] == 1 and real[b][k] == 0


def test_a_prompt_mask_padded_to_a_fixed_length_whose_zeros_are_one_token_id(tmp_path):
    """deepspeedai/DeepSpeedExamples#468 (written blind, batch blind-s): the PPO actor generates from prompts the
    collator left-pads to a fixed length (no row whole), the prompt mask (plain `mask`) held by the trainer and never
    handed to generate. Its zeros are exactly the input ids' pad tokens, so it is padding, not a loss mask."""
    found = check_bug(tmp_path, "ds_chat_ppo_generate_without_prompt_attention_mask", "padding-unused")
    real = [[0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]
    assert tuple(found[0]["cell"]) == first((2, 8, 8), _left_padding_seen(real))
    # written another way: SDPA's is_causal, the mask named attention_mask, the pad id a module-level constant
    found = check_bug(tmp_path, "fixed_length_left_pad_mask_not_passed", "padding-unused", HELD)
    real = [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]]
    assert tuple(found[0]["cell"]) == first((2, 7, 7), _left_padding_seen(real))


def test_a_loss_mask_over_a_prompt_of_many_ids_is_not_read_as_padding():
    """A held 0/1 mask that zeros a prompt of several token ids (a loss mask) is not padding; zeros at exactly one id,
    found nowhere else, are (checked against the rule's own helper on hand-made rows)."""
    from maskcli.checks.held import readings

    held = {"kind": "keep", "name": "mask", "rows": np.array([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]], dtype=bool)}
    loss_ids = np.array([[7, 8, 9, 4, 5], [7, 9, 4, 5, 6]])
    pad_ids = np.array([[2, 2, 2, 4, 5], [2, 2, 4, 5, 6]])
    assert readings(held, 2, 5, (loss_ids,)) == []
    assert [t.tolist() for t in readings(held, 2, 5, (pad_ids,))] == [held["rows"].tolist()]
    assert readings(held, 2, 5, (np.where(pad_ids == 4, 2, pad_ids),)) == []  # the pad id among the real tokens too
    image = {**held, "rows": np.array([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=bool)}  # two placeholders each row
    assert readings(image, 2, 5, (np.array([[9, 9, 4, 5, 6], [9, 9, 7, 5, 6]]),)) == []

def test_icefall_zipformer_downsampled_encoder_padding_mask_is_attn_mask(tmp_path):
    """k2-fsa/icefall#767: Zipformer's downsampled stack is called with the attention mask (None) as its key padding mask
    (written blind, batch blind-q; caught before any rule was changed for it)."""
    check_bug(tmp_path, "icefall_zipformer_downsampled_encoder_padding_mask_is_attn_mask", "padding-unused")


def test_mobius_qwen3_asr_audio_encoder_mask_not_plumbed(tmp_path):
    """onnxruntime/mobius#264: Qwen3-ASR's audio encoder gets no mask, so padded mel tokens are attended
    (written blind, batch blind-q; caught before any rule was changed for it)."""
    check_bug(tmp_path, "mobius_qwen3_asr_audio_encoder_mask_not_plumbed", "padding-unused")

def test_deepspeed_hybrid_engine_bloom_mask_inverted_twice(tmp_path):
    """DeepSpeed#5101: the already-inverted HF mask inverted again, so each left-padded row attends its padding only.
    Its fix adds input_mask * -10000 to the scores, whose decode cells land on both sides of -1e4: read as an additive
    mask (trace/masks.py), not a fill of one cell, it is quiet (written blind, batch blind-r)."""
    check_bug(tmp_path, "deepspeed_hybrid_engine_bloom_mask_inverted_twice", "padding-only-attended")


def test_tgi_gemma3_flashinfer_padded_custom_mask(tmp_path):
    """text-generation-inference#3324: the padded (B, 1, L, L) Gemma 3 mask (image spans both ways) handed to
    flashinfer, which reads request i's block flattened at its packed offset: each request's call sees cells its own
    block hides (written blind, batch blind-r). The fix unpads the mask: every call is its request's block."""
    hit = check_bug(tmp_path, "tgi_gemma3_flashinfer_padded_custom_mask", "held-mask-ignored")[0]
    assert "2 requests padded to 9" in hit["message"], hit


def _prefix_lm(b: int, q: int, k: int, lengths, prefixes) -> bool:
    """Request b's prefix-LM cell by a plain test: its prefix both ways, then causal, inside its length."""
    n, p = lengths[b], prefixes[b]
    return q < n and k < n and (k <= q or (q < p and k < p))


def test_a_request_loop_that_reuses_the_first_requests_mask(tmp_path):
    """Written another way: a prefix-LM batch held as attention_mask (B, 1, L, L), each request attended in a loop,
    every block sliced from request 0's mask. Request 1's call (4 tokens, prefix 1) is flagged at the first cell it sees
    that its own block hides, by a double loop; the fix (request i's block) is quiet."""
    lengths, prefixes = [6, 4], [3, 1]
    hit = check_bug(tmp_path, "prefix_lm_request_loop_reuses_first_mask", "held-mask-ignored", HELD)[0]
    expected = first((1, 4, 4), lambda _, q, k: _prefix_lm(0, q, k, lengths, prefixes)
                     and not _prefix_lm(1, q, k, lengths, prefixes))
    assert tuple(hit["cell"]) == expected == (0, 0, 1), hit


def test_a_left_padded_request_loop_over_each_requests_own_block_is_quiet(tmp_path):
    """The same loop on a left-padded batch, each request attending its own bottom-right block: quiet (the block a
    request's call keeps to may be either corner of its padded mask)."""
    text = (HELD / "prefix_lm_request_loop_reuses_first_mask.py").read_text()
    text = text.replace("hidden[i:i + 1, :n]", "hidden[i:i + 1, hidden.shape[1] - n:]")
    text = text.replace("attention_mask[row:row + 1, :, :n, :n]", "attention_mask[i:i + 1, :, -n:, -n:]")
    text = text.replace("real = (q_pos < n) & (k_pos < n)", "real = (q_pos >= size - n) & (k_pos >= size - n)")
    text = text.replace("((q_pos < p) & (k_pos < p))", "((q_pos < size - n + p) & (k_pos < size - n + p))")
    assert text.count("-n:") == 2 and "size - n + p" in text
    (tmp_path / "left.py").write_text(text)
    status, found, report = traced(tmp_path, "left", False, tmp_path)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_espnet_forward_one_step_no_memory_mask(tmp_path):
    """espnet#5679: main holds `hlens` (a one-letter-prefixed lengths name, ESPnet's) while forward_one_step hands the
    source attention `memory_mask=None`; its softmax masks nothing, yet its layer was handed the memory as `key`
    apart from its `query` (a cross-attention), so it is read against the held lengths."""
    check_bug(tmp_path, "espnet_decoder_forward_one_step_no_memory_mask", "padding-unused")


def test_source_attention_ilens_left_padded(tmp_path):
    """Written another way: `ilens` over a left-padded memory, a plain function attending one query per step; either
    way the lengths may lie, the query sees padded frames (the first cell a double loop's over the right-padded
    reading, read first). The mask handed on is quiet."""
    status, found, report = traced(tmp_path, "source_attention_ilens_never_passed", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-unused")
    assert hit["severity"] == "wrong"
    lengths = [4, 7]
    assert tuple(hit["cell"]) == first((2, 1, 7), lambda b, q, k: k >= lengths[b])
    status, found, report = traced(tmp_path, "source_attention_ilens_never_passed", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_one_letter_lengths_names():
    """ESPnet's `ilens` / `hlens` / `olens` are lengths; `maxlen`, `max_len` and `cu_seqlens` are not."""
    from maskcli.trace.held import LENGTHS

    assert all(LENGTHS.search(n) for n in ("ilens", "hlens", "olens", "src_len", "lengths", "seq_lens"))
    assert not any(LENGTHS.search(n) for n in ("maxlen", "max_len", "cu_seqlens", "helens"))


def test_lengths_beside_a_left_padded_is_pad_name_a_cell_the_program_calls_padding(tmp_path):
    """tests/data/dropped/bool_pad_mask_fill_discarded.py holds `lengths` [5, 3] (right- or left-padded) and the
    left-padded `is_pad` it built from them: the finding names is_pad's reading, whose cell is a real query seeing a
    left pad (it named lengths' right-padded reading before: query 0, a pad, seeing key 3, a real token)."""
    status, found, report = traced(tmp_path, "bool_pad_mask_fill_discarded", False,
                                   Path(__file__).parent / "data" / "dropped")
    [hit] = [f for f in found if f["code"] == "padding-unused"]
    assert status == 1 and "is_pad in main()" in hit["message"], report
    pad = [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]  # lengths 5 and 3 of 5, padded on the left
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: not pad[b][q] and pad[b][k])


def test_t5_generate_encoder_mask_dropped_for_cross_attention_chronos_context(tmp_path):
    """huggingface/transformers#36018: generate handed the decode steps no encoder mask, so cross-attention saw the
    left-padded context (written blind, batch blind-ac, a Chronos-style context; caught before any rule was changed
    for it, as padding-unused). The fix is quiet. Said now by encoder-padding-ignored, which reads the padding off the
    encoder's own self-attention (checks/memory.py) and speaks for padding-unused (engine.SAID_BY): the cells against a
    double loop over the context's left padding (row 1: 5 pads, never to be seen)."""
    pytest.importorskip("transformers")  # (its T5Config)
    [hit, *_] = check_bug(tmp_path, "t5_generate_encoder_mask_dropped_for_cross_attention_chronos_context",
                          "encoder-padding-ignored")
    assert tuple(hit["cell"]) == first((2, 1, 11), lambda b, q, k: b == 1 and k < 5)


def test_mlx_vlm_llava_language_overwrites_caller_mask(tmp_path):
    """Blaizzy/mlx-vlm#1913 (c070536e): LLaVA's language model replaces the caller's padding-aware mask with a plain
    causal one (written blind, batch blind-ad, a torch port; caught before any rule was changed for it). The fix is
    quiet."""
    check_bug(tmp_path, "mlx_vlm_llava_language_overwrites_caller_mask", "held-mask-ignored")


def test_a_padding_query_over_a_static_cache_placed_at_its_cache_position_is_not_judged(tmp_path):
    """tt-xla#2953's fix, written another way: the 12-slot padding mask the model call holds is left-padded, the prompt's
    5 queries sit at input_pos 0-4 over 12 slots, and a padding query's empty row is opened on every slot. Fewer
    queries than keys no longer means each is judged where the model call states where they sit: no padding-unused
    (said before: `batch row 1: query 0 sees key 0`)."""
    status, found, report = traced(tmp_path, "static_cache_left_padded_unmasked_pad_rows", False, QUIET)
    assert [f for f in found if f["code"] == "padding-unused"] == [], report
    assert status == 0, report
def test_a_ragged_batch_attended_one_request_at_a_time_is_not_padding(tmp_path):
    """Requests of 9, 5 and 7 tokens packed with no padding, one softmax per request (its 3 heads on the batch axis,
    as many as the requests), longest first, `lengths` handed to the model call: each call has exactly its request's
    keys, so neither padding-unused (the lengths held) nor padding-ignored (the lengths handed on) is said, where each
    was before (sgl-project/sglang#35434's fix: the CPU extend kernel's stage 2 over one request)."""
    status, found, report = traced(tmp_path, "ragged_requests_one_at_a_time", False, QUIET)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report
    status, found, report = traced(tmp_path, "sglang_cpu_extend_attention_encoder_only_causal", True,
                                   Path(__file__).parent / "data" / "bugs")
    assert [f for f in found if f["code"] == "padding-unused"] == [], report


def test_funasr_vllm_adaptor_blocks_attend_right_padding(tmp_path):
    """vllm-project/vllm#55167: vLLM's FunASR adaptor blocks run attention with no lengths, so a short request attends
    the batch's right padding (batch blind-ai). Its later run of one row alone holds the batch's lengths too:
    that is no ragged loop (the site's calls are counted within one model call); written blind and caught before
    any rule was changed for it. The fix is quiet."""
    check_bug(tmp_path, "funasr_vllm_adaptor_blocks_attend_right_padding", "padding-unused")


def test_opennmt_decoder_layer_dec_mask_reset_to_none(tmp_path):
    """OpenNMT-py#1044 (batch blind-bj): `dec_mask = None` left after the decoder layer built it, so the self-attention
    ran unmasked. The layer holds `tgt_pad_mask` (B, 1, L), read as its (B, L), beside `src_pad_mask` of as many keys,
    which the context attention keeps to: the memory's, left out of the self-attention's readings (it used to make the
    call quiet, as a padding "kept"). The first cell is a double loop's over the target padding."""
    [hit] = [f for f in check_bug(tmp_path, "opennmt_transformer_decoder_layer_dec_mask_reset_to_none", "padding-unused")
             if "tgt_pad_mask" in f["source"]][:1]
    dec_in = [[2, 13, 14, 15, 16], [2, 17, 18, 3, 1]]  # (PAD = 1)
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: dec_in[b][q] != 1 and dec_in[b][k] == 1)


def test_a_decoders_self_attention_mask_dropped_beside_a_padded_memory(tmp_path):
    """Written another way: (B, 1, 1, L) padding masks (True = padding) held as target_padding_mask and
    source_padding_mask, the source as long as the target and padded in the other row, an einsum attention; the fix
    (target padding AND the causal triangle) is quiet."""
    [hit] = check_bug(tmp_path, "decoder_self_mask_dropped_beside_memory", "padding-unused", folder=HELD)
    assert "target_padding_mask" in hit["source"]
    target = [[1, 21, 22, 23, 0, 0], [1, 24, 25, 26, 27, 28]]
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: target[b][q] != 0 and target[b][k] == 0)


def test_practical_nlp_attention_head_drops_padding_mask(tmp_path):
    """keitakurita/Practical_NLP_in_PyTorch#8 (batch blind-bj): AttentionHead calls its ScaledDotProductAttention
    without the (B, L, L) pad mask (True = padding) it was handed; the fix fills the exp with 0 before its sum, which
    trace now reads as the mask (trace/after.py). The mask, handed down as `mask`, is a key row expanded over the
    queries: read as the padding (checks/heldkeys.py)."""
    [hit] = check_bug(tmp_path, "practical_nlp_transformer_attention_head_drops_padding_mask", "padding-unused")
    tokens = [[5, 7, 3, 9, 11, 2], [4, 8, 6, 0, 0, 0]]
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: tokens[b][q] != 0 and tokens[b][k] == 0)


def test_an_expanded_keep_mask_dropped_on_a_left_padded_batch(tmp_path):
    """Written another way: left padding, a (B, L, L) keep mask (True = may attend) named attn_mask, a plain softmax."""
    [hit] = check_bug(tmp_path, "expanded_keep_mask_dropped_left_padded", "padding-unused", folder=HELD)
    pad = [[1, 1, 0, 0, 0], [0] * 5, [1, 1, 1, 0, 0]]
    assert tuple(hit["cell"]) == first((3, 5, 5), lambda b, q, k: not pad[b][q] and bool(pad[b][k]))


def test_a_key_row_broadcast_over_the_queries_is_read_as_its_padding(monkeypatch):
    """trace/held.py reads (B, 1, L) and (B, 1, 1, L) masks under a padding mask's name as their (B, L), and not under
    a keep mask's name."""
    import torch

    from maskcli.trace import held

    monkeypatch.setattr(held, "_SKIP", ("/nonexistent",))

    def inner():
        tgt_pad_mask = torch.tensor([[False, False, True], [False, False, False]]).unsqueeze(1)
        attention_mask = torch.tensor([[1, 0, 0], [1, 1, 1]])[:, None, None, :]
        return held.padding()

    found = {one["name"]: one for one in inner()}
    assert found["tgt_pad_mask"]["kind"] == "pad" and found["tgt_pad_mask"]["rows"].tolist() == [[0, 0, 1], [0, 0, 0]]
    # named as a keep mask, a broadcast (B, 1, 1, L) says no polarity: True = kept in HF, True = masked in Megatron
    assert "attention_mask" not in found


def test_hourglass_attention_resampling_sees_padding(tmp_path):
    """hourglass-transformer-pytorch 674ede1 (written blind, blind-cj): each pooled token attends to its bucket of 4,
    the buckets folded into the batch `(b n) s`, with no mask; the model call holds `mask` (2, 16), row 1 real to 10.
    The cell is a double loop's over that mask read in chunks of 4: a row with a real key that sees a padded one."""
    [hit] = check_bug(tmp_path, "hourglass_attention_resampling_sees_padding", "padding-unused")
    real = [[True] * 16, [True] * 10 + [False] * 6]
    chunk = lambda r, k: real[r // 4][(r % 4) * 4 + k]  # noqa: E731 - batch row r is bucket r % 4 of sequence r // 4
    assert tuple(hit["cell"]) == first((8, 1, 4), lambda r, q, k: any(chunk(r, j) for j in range(4))
                                      and not chunk(r, k))
    assert "16 positions, folded into the batch in chunks of 4" in hit["message"], hit


def test_chunk_pooling_context_padding_dropped(tmp_path):
    """Written another way: a funnel pooler's one query per chunk of 4, left-padded rows of 16, 10 and 5 real tokens,
    `attention_mask` (1 = real), the chunk handed as `context`; its fix hides the padded keys (a chunk of padding alone
    sees none, under a finite fill: quiet, emptyreal.py)."""
    [hit] = check_bug(tmp_path, "chunk_pooling_context_padding_dropped", "padding-unused", folder=HELD)
    real = [[k >= 16 - n for k in range(16)] for n in (16, 10, 5)]
    chunk = lambda r, k: real[r // 4][(r % 4) * 4 + k]  # noqa: E731
    assert tuple(hit["cell"]) == first((12, 1, 4), lambda r, q, k: any(chunk(r, j) for j in range(4))
                                       and not chunk(r, k))


def test_infini_transformer_local_attention_not_causal(tmp_path):
    """dingo-actual/infini-transformer#4 (written blind, blind-cj): the LM builds `torch.tril` over a segment and hands
    it to each layer, which never passes it to its scores: the layer's `mask` (8, 8), over a batch of 2, cannot be the
    batch's padding, and every query sees the later keys of its segment (the first: query 0, key 1)."""
    [hit] = check_bug(tmp_path, "infini_transformer_local_attention_not_causal", "held-mask-ignored")
    import torch

    tril = torch.ones(8, 8).tril().bool()
    assert tuple(hit["cell"]) == first((2, 8, 8), lambda b, q, k: not tril[q, k])


def test_block_recurrent_causal_mask_dropped_on_sdpa(tmp_path):
    """Written another way: a block-recurrent LM's (6, 6) triangle handed to each layer with the recurrent state, the
    SDPA path called without it (a batch of 3); its fix hands attn_mask=mask."""
    [hit] = check_bug(tmp_path, "block_recurrent_causal_mask_dropped_on_sdpa", "held-mask-ignored", folder=HELD)
    assert tuple(hit["cell"]) == first((3, 6, 6), lambda b, q, k: k > q)


def test_a_square_mask_that_may_be_the_batch_padding_is_not_read_as_cells():
    """heldcells._square: a (L, L) `mask` over a batch of L rows (or a batch L divides) is the batch's padding, not
    cells; one of another size is cells (1, L, L)."""
    from maskcli.checks.heldcells import _square

    table = np.tril(np.ones((4, 4), dtype=bool))
    held = {"kind": "keep", "name": "mask", "rows": table, "where": "f()"}
    assert _square([held], 4, 4, 4) == [] and _square([held], 8, 4, 4) == []
    assert _square([{**held, "name": "input_mask"}], 3, 4, 4) == []
    [cells] = _square([held], 3, 4, 4)
    assert cells["kind"] == "cells" and cells["rows"].shape == (1, 4, 4) and (cells["rows"][0] == table).all()


# a padding over the tokens of a self-attention whose keys hold a few more (checks/heldextra.py): read at either end

def test_lerobot_act_vae_encoder_never_masks_the_padded_action_steps(tmp_path):
    """huggingface/lerobot#279 (commit 4895166; written blind, batch blind-co): the VAE encoder over [cls, robot_state,
    *action_chunk] runs nn.MultiheadAttention with no key_padding_mask while `batch["action_is_pad"]` (a dict entry of
    the batch encode_latent is handed) covers the 12 action steps; sample 1's last 7 are padding. Fix: the mask with
    the cls and state keys' False prepended, handed to every layer: quiet. The cell is padding whichever end the
    action steps lie at, against a double loop."""
    [hit] = check_bug(tmp_path, "lerobot_act_vae_encoder_action_is_pad_not_masked", "padding-unused")
    assert 'batch["action_is_pad"]' in hit["message"] and "of 12 tokens, the last or the first of these 14" in hit["message"]
    n_real = (12, 5)
    pad_after = lambda b, k: n_real[b] + 2 <= k  # noqa: E731  (the actions after cls and state: keys 2-13)
    pad_before = lambda b, k: n_real[b] <= k < 12  # noqa: E731  (the actions first: keys 0-11)
    real_q = lambda b, q: not pad_after(b, q) and not pad_before(b, q)  # noqa: E731
    assert tuple(hit["cell"]) == first((2, 14, 14), lambda b, q, k: real_q(b, q) and pad_after(b, k) and pad_before(b, k))


def test_an_event_encoders_appended_registers_see_the_left_padding(tmp_path):
    """Written another way (tests/data/held): a left-padded batch of three event sequences, two register tokens
    appended after them, an einsum softmax attention whose bias is built only when `mask_events` is set (it is not);
    the collator's `attention_mask` (1 = real) covers the events alone. Fix: the mask padded with the registers'
    ones and added: quiet."""
    [hit] = check_bug(tmp_path, "event_encoder_registers_appended_padding_dropped", "padding-unused", folder=HELD)
    lengths = (6, 2, 4)  # of 6 events, left-padded; the registers are keys 6 and 7
    pad_first = lambda b, k: k < 6 - lengths[b]  # noqa: E731  (the events are keys 0-5)
    pad_after = lambda b, k: 2 <= k < 8 - lengths[b]  # noqa: E731  (read as put after two tokens: keys 2-7)
    real_q = lambda b, q: not pad_first(b, q) and not pad_after(b, q)  # noqa: E731
    assert tuple(hit["cell"]) == first((3, 8, 8), lambda b, q, k: real_q(b, q) and pad_first(b, k) and pad_after(b, k))


def test_a_padding_mask_in_a_dict_of_the_batch_is_read_as_held():
    """trace/held.py: a dict of the batch's tensors is looked through for entries named as a padding mask (not a plain
    "mask"), named as the variable that holds the same tensor where the frame has one; other dicts are not read."""
    import torch

    from maskcli.trace.held import padding

    pad = torch.tensor([[False] * 4, [False, False, True, True]])
    given = {"action_is_pad": pad, "mask": ~pad, "observation.state": torch.zeros(2, 3)}

    def encode(batch):
        return padding()

    def named(batch):
        action_pad_mask = batch["action_is_pad"]  # noqa: F841 - held by the frame under its own name
        return padding()

    def other(stuff):
        return padding()

    [read] = encode(given)
    assert read["name"] == 'batch["action_is_pad"]' and read["kind"] == "pad"
    assert (read["rows"] == pad.numpy()).all()
    assert [r["name"] for r in named(given)] == ["action_pad_mask"]
    assert other(given) is None


def test_speechbrain_encode_padding_mask_only_in_training(tmp_path):
    """speechbrain#915 (commit f541989): TransformerASR.encode() built src_key_padding_mask from the relative
    `wav_len` only `if self.training`, so an eval-mode encode (beam search) attends the padded frames."""
    check_bug(tmp_path, "speechbrain_transformer_asr_encode_padding_mask_only_in_training", "padding-unused")


def test_lengths_mask_built_only_in_training(tmp_path):
    """Written another way: absolute `src_lengths`, fairseq's padding helper, SDPA keep mask; the first cell and the
    count are a double loop's over the real queries and the padded keys of each row."""
    lengths = (5, 11, 8)
    [hit] = check_bug(tmp_path, "lengths_mask_built_only_in_training", "padding-unused", folder=HELD)
    assert tuple(hit["cell"]) == first((3, 11, 11), lambda b, q, k: q < lengths[b] <= k)
    assert f"({sum(n * (11 - n) for n in lengths)} such cells)" in hit["message"].replace("\n", " ")


def test_megatron_ul2_decoder_only_mask_without_head_axis(tmp_path):
    """bigscience-workshop/Megatron-DeepSpeed 538c30b (written blind, batch blind-dd): get_batch handed the UL2
    prefix-LM dec_mask as [b, s, s] beside [b, np, s, s] scores (b == np): head h of each row used row h's prefix.
    Said as that row's mask (headrows.py's mask-of-another-row), not as the held mask ignored."""
    check_bug(tmp_path, "megatron_deepspeed_ul2_decoder_only_dec_mask_missing_head_axis", "mask-of-another-row")


def test_keep_mask_without_head_axis_left_padded(tmp_path):
    """Written another way: a left-padded causal keep mask (True = may attend) (b, q, k) handed to SDPA beside
    (b, h, q, k) scores, b == h; the first cell is a double loop's over the first head whose mask (row b, head h
    reads row h) differs from the mask the model holds for row b (headrows.py's mask-of-another-row)."""
    [hit] = check_bug(tmp_path, "left_padded_keep_mask_without_head_axis", "mask-of-another-row", folder=HELD)
    starts = (0, 4, 2)  # (each row's left padding)

    def keep(b, q, k):
        return q == k or (k <= q and k >= starts[b])

    bad = next((b, q, k) for b in range(3) for h in range(3) for q in range(9) for k in range(9)
               if keep(b, q, k) != keep(h, q, k))
    assert tuple(hit["cell"]) == bad


def test_mmada_llada_attention_bias_dropped(tmp_path):
    """Gen-Verse/MMaDA#19 (written blind, batch blind-dd): t2i_generate holds the CFG batch's attention_mask and builds
    attention_bias from it; LLaDABlock calls SDPA with attn_mask=None."""
    check_bug(tmp_path, "mmada_llada_block_attention_bias_dropped_t2i_cfg", "padding-unused")


def test_diffusion_lm_bias_built_never_added(tmp_path):
    """Written another way: right-padded, the sampler's additive bias handed to blocks that score by hand and never
    add it; the first cell is a double loop's over the real queries and padded keys."""
    lengths = (10, 6)
    [hit] = check_bug(tmp_path, "diffusion_lm_bias_built_never_added", "padding-unused", folder=HELD)
    assert tuple(hit["cell"]) == first((2, 10, 10), lambda b, q, k: q < lengths[b] <= k)


def test_lmflow_bloom_flash_attention_alibi_bias_ignores_padding(tmp_path):
    # OptimalScale/LMFlow commit 9f668252 ("fix support for attention_mask"; written blind, batch blind-dk, caught
    # before any rule was changed for it): the Bloom flash-attention patch handed `alibi * beta` as the bias, the 2-D
    # attention_mask its forward holds never masked in; left-padded rows attend their pad keys
    found = check_bug(tmp_path, "lmflow_bloom_flash_attention_alibi_bias_ignores_padding", "padding-unused")
    pads = (0, 4)  # lengths [10, 6] left-padded to 10; the kernel is causal
    assert tuple(found[0]["cell"]) == first((2, 10, 10), lambda b, q, k: k < pads[b] <= q and k <= q)
    assert "(24 such cells)" in found[0]["message"]


def test_alibi_encoder_bias_built_without_padding(tmp_path):
    """LMFlow 9f668252 written another way: a bidirectional ALiBi encoder, right-padded, SDPA, its bias built by the
    model from the slopes alone while embed() holds the attention_mask; the first cell is a double loop's."""
    found = check_bug(tmp_path, "alibi_encoder_bias_without_padding", "padding-unused", folder=HELD)
    lengths = (7, 4, 9)
    assert tuple(found[0]["cell"]) == first((3, 9, 9), lambda b, q, k: q < lengths[b] <= k)
    assert "(34 such cells)" in found[0]["message"]


def test_gpt_sovits_left_padding_mask_as_an_outer_product(tmp_path):
    """RVC-Boss/GPT-SoVITS#2153 (053a356; written blind, batch blind-dl, caught before any rule was changed for it):
    infer_panel_batch_infer's left padding `padding_mask.unsqueeze(1) * padding_mask.unsqueeze(2)` masks only pad
    query / pad key pairs, so real tokens see the padded text slots. The first cell, by a double loop over the
    texts' lengths (4, 10, 7 left-padded to 10, then a 5-frame prompt; real queries only)."""
    found = check_bug(tmp_path, "gpt_sovits_t2s_batch_infer_padding_mask_outer_product", "padding-unused")
    pad = [10 - n for n in (4, 10, 7)]
    assert tuple(found[0]["cell"]) == first((3, 15, 15), lambda b, q, k: q >= pad[b] > k), found[0]


def test_a_keep_mask_built_as_the_or_of_the_real_flags(tmp_path):
    """Written another way: a right-padded speech batch whose helper holds the lengths and hands SDPA
    `valid[:, :, None] | valid[:, None, :]` (True = keep), which hides only the pad-pad pairs. The first cell, by a
    double loop over the lengths."""
    found = check_bug(tmp_path, "speech_encoder_keep_mask_or_of_real_flags", "padding-unused", folder=HELD)
    lengths = (9, 5, 7)
    assert tuple(found[0]["cell"]) == first((3, 9, 9), lambda b, q, k: q < lengths[b] <= k), found[0]


def test_a_generate_loops_decoder_mask_held_beside_its_encoder_is_not_the_encoders(tmp_path):
    """A speech generate loop holds its decoder's left-padded mask of 7 tokens while its encoder attends 8 frames of
    audio: the decoder model call states that very mask as its decoder_attention_mask, so it is not read as the
    encoder's 7 tokens beside a token of the model's own (heldextra.py); the Whisper longform loop of transformers
    PR #48028 (blind-dz), whose --fixed run main called padding-unused, in plain torch. No frame is padding: quiet."""
    status, found, report = traced(tmp_path, "speech_generate_loop_decoder_mask_held_beside_encoder", False, HELD)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def _pads_both_ends(shape: tuple[int, int, int], left_pads: tuple[int, ...], extra: int):
    """The reference for a script's (B, w) left-padded keep mask over a causal self-attention of w + extra keys, read
    with the extra (real) tokens before the text or after it: a real query under both readings that sees a key both
    call padding (a double loop over the cells)."""
    def pad(b, key, before):
        at = key - extra if before else key
        return 0 <= at < shape[2] - extra and at < left_pads[b]

    return first(shape, lambda b, q, k: k <= q and not pad(b, q, True) and not pad(b, q, False)
                 and pad(b, k, True) and pad(b, k, False))


def test_nanovlm_generate_drops_the_left_padding_mask(tmp_path):
    """huggingface/nanoVLM 8c87101 + 1e1e95c (written blind, batch blind-dy): generate() rebinds the attention_mask it
    is handed to None and calls the decoder over [4 image tokens | left-padded prompt] without it; the script's
    top-level `mask` is the batch's padding, the ids generate holds pad exactly where it is 0."""
    found = check_bug(tmp_path, "nanovlm_generate_left_padding_mask_dropped", "padding-unused")
    assert tuple(found[0]["cell"]) == _pads_both_ends((2, 12, 12), (0, 5), 4)


def test_prompt_tuning_wrapper_filters_out_attention_mask(tmp_path):
    """Written another way: a prompt-tuning wrapper prepends 3 soft tokens and passes on only the keyword arguments
    the model's forward names (key_padding_mask), so the script's `attention_mask` never reaches SDPA's causal call."""
    found = check_bug(tmp_path, "prompt_tuning_wrapper_filters_out_attention_mask", "padding-unused", folder=HELD)
    assert tuple(found[0]["cell"]) == _pads_both_ends((2, 10, 10), (0, 4), 3)


def _bidirectional_padding_seen(lengths: tuple[int, ...]):
    """bad(b, q, k) of an unmasked encoder over right-padded rows: a real query sees a pad key, by a double loop."""
    return lambda b, q, k: q < lengths[b] <= k


def test_a_tokenizers_mask_never_handed_to_its_text_encoder_is_found(tmp_path):
    """black-forest-labs/flux#507 (closed unmerged; the same change in #511 / #512; blind-ea): HFEmbedder.forward pads
    the prompts to max_length (no row whole) and calls T5 with attention_mask=None, `batch_encoding["attention_mask"]`
    held beside its `input_ids`. Written another way: a diffusers-style pipeline's `text_inputs` (a UserDict
    BatchEncoding read by attribute), three prompts, a BERT encoder handed `text_inputs.input_ids` alone."""
    found = check_bug(tmp_path, "flux_hfembedder_t5_padding_mask_not_passed", "padding-unused")
    assert tuple(found[0]["cell"]) == first((2, 24, 24), _bidirectional_padding_seen((3, 11)))
    assert 'batch_encoding["attention_mask"]' in found[0]["message"]
    found = check_bug(tmp_path, "pipeline_text_inputs_mask_not_passed", "padding-unused", HELD)
    assert tuple(found[0]["cell"]) == first((3, 16, 16), _bidirectional_padding_seen((5, 11, 3)))
    assert 'text_inputs["attention_mask"]' in found[0]["message"]



def test_starvla_action_head_ignores_vlm_padding(tmp_path):
    # starVLA/starVLA PR #315 (commit b6ab70e; issue #330): Qwen_GR00T never passed the VLM's attention_mask to the
    # flow-matching action head, so the DiT cross-attention attended the batch's padded prompt positions (written
    # blind, blind-eh)
    found = check_bug(tmp_path, "starvla_qwengr00t_action_head_ignores_vlm_padding_mask", "padding-unused")
    lengths = (12, 4)  # right padding: the second prompt's keys 4-11
    assert tuple(found[0]["cell"]) == first((2, 9, 12), lambda b, q, k: k >= lengths[b])
    assert 'qwen_inputs["attention_mask"]' in found[0]["message"]


def test_an_action_heads_cross_attention_never_handed_the_left_padded_language_mask(tmp_path):
    """The same bug written another way: nn.MultiheadAttention from action tokens to left-padded language features,
    the padding held as the observation dict's `language_attention_mask`, key_padding_mask never passed."""
    found = check_bug(tmp_path, "octo_readout_head_language_padding_not_passed", "padding-unused", HELD)
    pads = (0, 4)  # prompts of 7 and 3 tokens, left-padded to 7
    assert tuple(found[0]["cell"]) == first((2, 4, 7), lambda b, q, k: k < pads[b])
    assert 'observation["language_attention_mask"]' in found[0]["message"]


def test_perceiver_ar_step_drops_the_collators_pad_mask(tmp_path):
    """krasserm/perceiver-io 6b2a825 (PR #25; written blind, batch blind-ez, caught before any rule was changed for
    it): the step dropped the collator's pad mask and PerceiverAR's forward never applied the `pad_mask` it takes, so
    the latents' causal cross-attention to the left-padded prefix saw the padding."""
    found = check_bug(tmp_path, "perceiver_io_perceiver_ar_pad_mask_dropped", "padding-unused")
    pads, latents = (0, 8), 8  # 24 and 16 real tokens left-padded to 24; the 8 latents are the last 8 positions
    hit = next(f for f in found if tuple(f["cell"][:1]) == (1,))
    assert tuple(hit["cell"]) == first((2, latents, 24), lambda b, q, k: k < pads[b] and k <= q + 24 - latents)
    assert "pad_mask in forward()" in hit["message"] and "built and never handed on" in hit["message"]


def test_a_training_step_that_drops_a_left_padded_batch_dicts_attention_mask(tmp_path):
    """The same bug written another way: SDPA is_causal=True over a left-padded batch dict whose attention_mask the
    training step never hands the model (`model(batch["input_ids"])`)."""
    found = check_bug(tmp_path, "left_padded_lm_step_drops_collator_attention_mask", "padding-unused", folder=HELD)
    pads = (4, 0, 2)  # 6, 10 and 8 tokens left-padded to 10
    assert tuple(found[0]["cell"]) == first((3, 10, 10), lambda b, q, k: q >= pads[b] and k < pads[b] and k <= q)
    assert 'batch["attention_mask"] in training_step()' in found[0]["message"]
    status, findings, report = traced(tmp_path, "left_padded_lm_step_drops_collator_attention_mask", True, HELD)
    assert [f for f in findings if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_decoder_mask_is_the_tokens_held_beside_it_and_a_causal_call_handed_it():
    """checks/heldextra._kept_in_order: a causal self-attention over a left-padded decoder prompt that hides the pad
    from every real query was handed that padding (the pad hidden from a later real query, a double loop's reading);
    causal order over right padding, which hides it whatever the mask, says nothing; a real query seeing a pad: no."""
    from maskcli.checks.heldextra import _kept_in_order

    def cells(real, keeps_pad):
        return np.array([[[k <= q and (real[b][k] or not real[b][q] or keeps_pad) for k in range(4)] for q in range(4)]
                         for b in range(len(real))])

    left = np.array([[True] * 4, [False, True, True, True]])
    right = np.array([[True] * 4, [True, True, True, False]])
    hidden_later = any(cells(left, False)[b, q, k2] and not cells(left, False)[b, q, k] for b in range(2)
                       for q in range(4) for k in range(4) for k2 in range(k + 1, 4) if left[b][q] and not left[b][k])
    assert hidden_later and _kept_in_order(cells(left, False), left)
    assert not _kept_in_order(cells(right, False), right)
    assert not _kept_in_order(cells(left, True), left)


def test_a_training_batchs_decoder_mask_beside_its_own_greedy_loop_is_not_the_loops(tmp_path):
    """Correct (tests/data/withheld): a batch dict's left-padded decoder prompts and their `decoder_attention_mask`,
    handed to the model at the training step; then the same function's greedy loop over fresh sequences of the same
    width, handed no mask. Neither the encoder's 5 keys (the decoder's self-attention over 4 was handed that padding,
    causal, the left pad hidden) nor the loop's decoder (other ids than the batch's `decoder_input_ids`, which the
    model's forward holds: trace/pairedids.inner_other) is read against it: no wrong or suspicious finding."""
    status, found, report = traced(tmp_path, "seq2seq_greedy_loop_beside_training_batch_decoder_mask", False,
                                   Path(__file__).parent / "data" / "withheld")
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_sentence_run_alone_over_heads_folded_into_the_batch_beside_the_batch_lengths_is_quiet(tmp_path):
    """quiet-zx's MPNet encoder written small: each sentence run alone folds its 4 heads into the batch, (4, 1, L, L),
    as many rows as main()'s 4 `lengths`; the model call was handed 1 row of ids over exactly those L keys, so the
    lengths are another batch's (checks/heldfold.handed_batch), not its rows'. The padded batch keeps to them."""
    status, found, report = traced(tmp_path, "sentences_alone_heads_folded_beside_batch_lengths_quiet", False, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_installed_packages_are_no_programs_frames_in_a_venv_too():
    """A venv's site-packages lies outside the standard library's folder (python's own install holds it inside): in a
    venv, transformers' forward frames were read as the program's, and their attention_mask held as the program's
    padding mask (pad-ids-unmasked on correct Marian, PEGASUS-X and LayoutLMv3 programs run in a venv)."""
    import sysconfig

    from maskcli.trace.held import _skipped, names

    paths = sysconfig.get_paths()
    assert paths["purelib"] in _skipped() and paths["platlib"] in _skipped()
    pytest.importorskip("transformers")  # (an installed package's code, wherever the environment keeps it)
    from transformers.models.marian import modeling_marian

    assert names(modeling_marian.MarianEncoder.forward.__code__) is None


def test_a_batchs_lengths_held_outside_a_loop_over_each_row_alone_are_not_its_calls():
    """Written otherwise (Sockeye's beam search checked source by source, quiet_blind round 60): main() holds the padded
    batch's `lengths` (4,) and runs each source alone through a function holding that source's `src_lengths` (1,), which
    the model's encoder takes as `valid_length` (a name read as nothing of a 1-D tensor: the same tensor under a name
    that says nothing may say something under an outer one) and folds with its heads into the batch axis (4 rows, as
    many as the outer lengths). Each row alone sees every one of its keys, and so does the padded batch's call within
    its lengths: no padding-unused. The nearer function's lengths over fewer rows say the outer ones are another
    batch's."""
    import torch
    from torch import nn

    import maskcli

    heads, dim = 4, 8

    class Encoder(nn.Module):
        def forward(self, x, valid_length):
            b, n, _ = x.shape
            q = k = v = x.view(b, n, heads, dim // heads).transpose(1, 2).reshape(b * heads, n, dim // heads)
            keep = (torch.arange(n)[None, :] < valid_length.repeat_interleave(heads)[:, None])[:, None, :]
            return (q @ k.transpose(1, 2)).masked_fill(~keep, float("-inf")).softmax(-1) @ v

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Encoder()

        def encode(self, src, source_length):
            return self.encoder(src, source_length)

    def alone(model, src, src_lengths):
        return model.encode(src, src_lengths)

    def main():
        model, lengths = Model(), torch.tensor([5, 3, 4, 2])
        batch = torch.randn(4, 5, dim) * (torch.arange(5)[None, :, None] < lengths[:, None, None])
        model.encode(batch, lengths)
        for i in range(4):
            alone(model, batch[i:i + 1, :int(lengths[i])], lengths[i:i + 1].clone())

    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        main()
    held = [[h["rows"].tolist() for h in call.details.get("held_padding") or ()] for call in t.calls]
    assert held == [[[5, 3, 4, 2]], [[5]], [[3]], [[4]], [[2]]]  # (each call's own lengths, none another batch's)
    assert [f.code for group in t.groups() for f in group.findings if f.code == "padding-unused"] == []


def _graph_attention(drop: bool) -> list:
    """Written otherwise (GraphCodeBERT's data-flow mask, quiet_blind round 60): a (1, 6, 6) bool `attention_mask`
    handed down, tokens 0-1 code (seeing each other and themselves), 2-3 data-flow nodes that see the code but not
    themselves, 4-5 pads that see nothing; the kernel adds (1 - mask) * -10000 to the scores, so the pads' rows, hidden
    whole, take softmax weights over every key (BERT's extended mask). `drop`: the kernel masks the causal triangle
    instead (the mask dropped). The held-mask-ignored findings."""
    import torch

    import maskcli

    def attend(x, attention_mask):
        scores = x @ x.transpose(1, 2)
        keep = torch.ones(6, 6).tril()[None] if drop else attention_mask.float()
        scores = scores + (1.0 - keep) * -10000.0
        return scores.softmax(-1) @ x

    mask = torch.zeros(1, 6, 6, dtype=torch.bool)
    mask[0, :2, :2] = True
    mask[0, 2:4, :2] = True
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        attend(torch.randn(1, 6, 4), mask)
    return [f.code for group in t.groups() for f in group.findings if f.code == "held-mask-ignored"]


def test_a_held_mask_whose_padding_rows_are_hidden_whole_is_kept_to_by_an_additive_fill():
    """The pads' rows, hidden whole by the held mask, are the kernel's to fill (uniform weights under a finite additive
    mask): quiet, though most tokens (nodes and pads) are hidden from themselves. The same mask dropped is said."""
    assert _graph_attention(drop=False) == []
    assert _graph_attention(drop=True) == ["held-mask-ignored"]


def test_a_prompts_padding_held_beside_decode_steps_that_attend_it_is_read_over_the_cache(tmp_path):
    """Donut's batched DocVQA prompts (NielsRogge/Transformers-Tutorials#323, written blind, blind-ja, round 60: its
    prompt mask held at the script's top level) written another way: generate() holds right-padded prompts'
    attention_mask (6 keys) but masks causally only, so each decode step (7, 8, 9 keys) attends the pads between
    the prompt and the generated tokens. The prompt's padding, as wide as the site's prefill, is the cache's first
    keys, the generated ones real. The fix pads on the left and keeps the mask (its rows equal each prompt alone)."""
    found = check_bug(tmp_path, "right_padded_prompts_decoded_over_their_pads", "padding-unused", folder=HELD)
    # the short row (3 real tokens, pads at 3-5): its first decode step's query sees key 3 (a double loop over the keys)
    assert tuple(found[0]["cell"]) == first((2, 1, 7), lambda b, q, k: b == 1 and 3 <= k < 6)
    assert "of its prompt's 6 tokens, the first of these 7 keys" in found[0]["message"].replace("\n", " ")


def test_a_segment_memory_models_mask_of_its_own_tokens_is_not_a_prompts(tmp_path):
    """compressive-transformer-pytorch 4b3ce19's fix (blind, a false alarm before): a segment of as many queries as
    its padding mask's tokens attends a memory of the segment before and itself; the mask is the segment's own (the
    last keys), not a prompt's laid over the first keys behind a cache, though the first segment ran over as many
    queries and keys as the mask holds. Written another way: SDPA, a right-padded last segment, the memory hidden
    states of the segment before: quiet."""
    status, found, report = traced(tmp_path, "segment_memory_mask_of_its_own_tokens_quiet", False, HELD)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_finished_rows_decode_steps_on_its_pads_are_not_real_queries(tmp_path):
    """XLM's generate (quiet-yv, written blind: a false alarm before): a row that emitted EOS keeps decoding PAD, the
    lengths its step function holds stop growing, and each of its later steps' query sits on a pad past them (the last
    key of a cache that grows by one a step). Written another way: SDPA over a concatenated cache, the lengths held by
    a helper's frame. Quiet: a finished row's pad queries see its pads, no real query does."""
    status, found, report = traced(tmp_path, "finished_rows_decode_their_pads_quiet", False, HELD)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_internlm_generation_mask_never_read_by_the_cached_attention(tmp_path):
    """InternLM/InternLM#396 (written blind, batch blind-ms; caught before any rule changed for it): the generation loop
    built a mask of each row's left padding every step, and the attention's cached path never read it, so padded rows
    attended their padding. The fix shifts each row's positions and masks its pads."""
    hit = check_bug(tmp_path, "internlm_inference_forward_ignores_left_pad_mask", "held-mask-ignored")[0]
    assert "attention_mask in _no_beam_search_generate()" in " ".join(hit["message"].split())


def test_a_generate_loops_mask_as_wide_as_the_prefill_by_chance_is_no_prompts_padding(tmp_path):
    """huggingface/peft#2106 (written blind, batch blind-ok): prompt tuning's generate put 4 virtual tokens before
    every key. At the fourth decode step the loop's attention_mask (8 prompt tokens and 4 generated) was as wide as the
    prefill (4 virtual and 8 prompt tokens), and was read as the prompt's padding over the first 12 keys: padding-unused
    on the fix, a false alarm. A mask is a prompt's padding over its cache only where the prefill was run with the same
    mask. The bug (the soft prompt never added, its mask 4 too long) is still found, and the fix is quiet."""
    found = check_bug(tmp_path, "peft_prompt_tuning_generate_empty_cache_truthy_no_injection", "padding-ignored",
                      folder=Path(__file__).parent / "data" / "blind")
    assert found[0]["message"].startswith("batch row 1: query 3 sees key 0"), found[0]["message"]


GIVENUP = Path(__file__).parent / "data" / "givenup"


def test_queries_the_held_mask_gives_up_whole_are_asked_no_other_mask(tmp_path):
    """A recompute pass whose attention marks every query past the context hidden from every key (CodeGeeX's loop, a
    quiet program written blind: an additive mask shifts those rows as a whole, and they attend everywhere) keeps to
    the mask it made: neither the causal mask a frame further out holds (held-mask-ignored) nor the cached steps'
    causal prefill (causal-lost) is asked of those rows."""
    status, found, report = traced(tmp_path, "recompute_rows_past_context_masked_whole", False, GIVENUP)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_rows_before_the_context_opened_whole_are_still_held_to_the_mask(tmp_path):
    """The same pass opening the context's own rows to every key (rows before the context set to keep): no row is
    given up, and the causal mask the model holds is broken."""
    text = (GIVENUP / "recompute_rows_past_context_masked_whole.py").read_text()
    text = text.replace("attention_mask[:, :, context_length:, :] = True", "attention_mask[:, :, :context_length, :] = False")
    text = text.replace("    assert all(", "    assert not all(")
    assert text.count(":context_length, :] = False") == 1
    (tmp_path / "opened.py").write_text(text)
    status, found, report = traced(tmp_path, "opened", False, tmp_path)
    assert status == 1, report
    assert {"held-mask-ignored", "causal-lost"} <= {f["code"] for f in found if f["severity"] == "wrong"}, report


def test_a_keep_mask_named_padding_where_the_run_names_it_real_too_is_not_turned_round(tmp_path):
    """keras-io#1997's fix (tests/data/bugs): Keras's masks are 1 = real, and the decoder's cross-attention is handed
    the encoder's `mask` (which its encoder frame holds under that name) as `encoder_outputs_padding_mask`, read by
    name as True = padding. The kernel keeps its real keys, the complement of that reading; the run names the same
    rows both ways round, so neither is a statement the mask contradicts: no padding-only-attended. The same kernel
    with the mask held only under the padding name is still read as turned round."""
    from checkbugs import BUGS

    name = "keras_io_nmt_decoder_cross_attention_masked_by_target_padding"
    status, found, report = traced(tmp_path, name, True, BUGS)
    assert "padding-only-attended" not in {f["code"] for f in found}, report
    text = (BUGS / f"{name}.py").read_text()
    once = text.replace("    def forward(self, inputs, mask=None):\n        padding_mask = None\n        if mask is not None:\n"
                        "            padding_mask = mask[:, None, :].int()",
                        "    def forward(self, inputs, keep=None):\n        padding_mask = None\n        if keep is not None:\n"
                        "            padding_mask = keep[:, None, :].int()").replace(
                        "self.encoder(x, mask=encoder_mask)", "self.encoder(x, keep=encoder_mask)")
    assert once != text
    (tmp_path / "once.py").write_text(once)
    status, found, report = traced(tmp_path, "once", True, tmp_path)
    assert "padding-only-attended" in {f["code"] for f in found}, report


def test_detrex_conditional_self_attention_never_applies_the_images_padding(tmp_path):
    """IDEA-Research/detrex 28f3d0d (written blind, blind-qm, caught after tuning): ConditionalSelfAttention took
    `key_padding_mask` (DETR's padded pixels, True = padding, flattened from (B, H, W)) and never applied it. Image 1 is
    7 of 12 patches wide and 6 of 8 tall: its first row's query sees key 7, the first padded patch."""
    [hit] = check_bug(tmp_path, "detrex_conditional_self_attention_masks_ignored", "padding-unused",
                      Path(__file__).parent / "data" / "blind")
    assert tuple(hit["cell"]) == (1, 0, 7) and "key_padding_mask in forward()" in hit["message"], hit


def test_an_encoder_layer_that_drops_the_images_padding_mask(tmp_path):
    """Written another way: a DETR-style encoder over a 5 x 7 and an 8 x 4 patch image padded to 8 x 7, whose layer
    takes `src_key_padding_mask` and calls nn.MultiheadAttention without it. Image 0's rows 5-7 are padding: its query 0
    sees key 35. --fixed hands it on: quiet."""
    [hit] = check_bug(tmp_path, "detr_encoder_layer_drops_src_key_padding_mask", "padding-unused",
                      Path(__file__).parent / "data" / "imagepad")
    assert tuple(hit["cell"]) == (0, 0, 35), hit


@pytest.mark.parametrize("real, image", [
    ([[1] * 12, [1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], True),  # (width 3: 2 x 2 of 4 x 3, 2 rows, and a whole image)
    ([[1] * 12, [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]], True),  # (right padding is a rectangle too: 1 x 6 of 2 x 6)
    ([[1] * 12, [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], False),  # (left padding: not bottom-right)
    ([[1] * 12, [1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0]], True),  # (width 2: one column of two)
    ([[1] * 12, [1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1]], False),  # (holes inside the rows)
    ([[1] * 12, [1] * 12], False),  # (no padding)
])
def test_image_padding_against_a_double_loop(real, image):
    """heldfold.image_padding: some width W whose (H, W) grid holds each row's real cells as a top-left rectangle,
    checked against a double loop over every width and every cell."""
    from maskcli.checks.heldfold import image_padding

    table = np.array(real, dtype=bool)
    rows, length = table.shape

    def fits(width):
        height = length // width
        spans = []
        for b in range(rows):
            tall = sum(1 for r in range(height) if table[b, r * width])
            wide = sum(1 for c in range(width) if table[b, c])
            if any(table[b, r * width + c] != (r < tall and c < wide) for r in range(height) for c in range(width)):
                return False
            spans.append((tall, wide))
        return min(min(s) for s in spans) > 0 and max(t for t, _ in spans) == height \
            and max(w for _, w in spans) == width and not table.all()

    assert image_padding(table) == image == any(fits(w) for w in range(2, length // 2 + 1) if length % w == 0)


def test_rtorch_mha_float_key_padding_mask_read_by_masked_fill(tmp_path):
    """mlverse/torch#1205, fixed by #1208 (6d277a82e; written blind, blind-rz, caught before any rule changed for it):
    R torch's nnf_multi_head_attention_forward passed any key_padding_mask to masked_fill, so a float 0 / -Inf mask
    masked nothing and the padded keys kept their weight. The fix adds a float mask to the weights."""
    [hit] = check_bug(tmp_path, "rtorch_mha_float_key_padding_mask_masked_fill", "padding-unused")
    assert tuple(hit["cell"]) == (2, 0, 4) and "batch row 2: query 0 sees key 4" in hit["message"], hit


def test_fastplms_stack_switched_to_flex_blocks_keep_sdpa_unmasked(tmp_path):
    """Synthyra/FastPLMs 616e7a7 (written blind, blind-te, caught before any rule changed for it): switching a built
    ESM++ model's stack to "flex" made it build only a block mask and hand its blocks attention_mask=None, while every
    block kept running SDPA: the 10-residue protein (12 tokens with <cls> and <eos>, right-padded to 28) attended its
    padding. The fix's setter hands the backend to every block. The first cell by a double loop."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "fastplms_esmplusplus_stack_backend_switch_blocks_keep_sdpa", "padding-ignored")[0]
    real = [2 + 26, 2 + 10]
    assert tuple(hit["cell"]) == first((2, 28, 28), lambda b, q, k: q < real[b] and k >= real[b])
    assert "the attention_mask given to ESMplusplusModel marks as padding" in " ".join(hit["message"].split())


def test_diffusers_llada2_pipeline_drops_the_prompts_padding_mask(tmp_path):
    """huggingface/diffusers#13598, fixed by #13698 (written blind, blind-tn, caught before any rule changed for it):
    `_prepare_input_ids` returned the ids alone and `__call__` built an all-ones mask, so the bidirectional denoiser
    attended the right-padded prompt's pads. The pipeline's own `attention_mask` (4 real tokens of row 1's 8 keys
    in the first block window) says which keys are padding; the fix carries it through."""
    found = check_bug(tmp_path, "diffusers_llada2_pipeline_prompt_padding_mask_dropped", "padding-unused")
    real = 4  # (row 1's prompt tokens; the rest of the window its right padding)
    b, q, k = tuple(found[0]["cell"])[:3]
    assert (b, q) == (1, 0) and k >= real and f"a padding mask (1 = real) of {real} tokens" in " ".join(
        found[0]["message"].split()), found[0]


def test_transformers_janus_image_generation_left_pads_unmasked(tmp_path):
    """huggingface/transformers#36053's review (written blind, blind-tv, caught before any rule changed for it): Janus's
    image generation doubled the batch for classifier-free guidance and handed the language model no mask, so the
    left-padded shorter prompt's pads fed every image token. The script's `attention_mask` holds the padding."""
    found = check_bug(tmp_path, "transformers_janus_image_generation_left_pads_unmasked", "padding-unused")
    assert "attention_mask in <module>()" in " ".join(found[0]["message"].split())


def test_perturbgen_decoder_self_attention_attends_the_padded_genes(tmp_path):
    """Lotfollahi-lab/Perturbgen#12, fixed by 427fdcd (written blind, blind-ty, caught before any rule changed for it):
    the decoder's `tgt_mask` held only the genes picked for masking, so every query attended the right-padded gene
    slots that `src_attention_mask` calls padding. Both runs keep upstream's cross-attention mask read the wrong way
    round (True = real masked), which leaves a fully real context masked whole: fully-masked, true of the fix too."""
    name = "perturbgen_tperturb_decoder_self_attention_pads_unmasked"
    status, found, report = traced(tmp_path, name, False, BLIND)
    assert "padding-unused" in {f["code"] for f in found if f["severity"] == "wrong"}, report
    status, found, report = traced(tmp_path, name, True, BLIND)
    assert {f["code"] for f in found if f["severity"] == "wrong"} == {"fully-masked"}, report


def test_paddlenlp_static_gpt3_prefill_adds_the_prompt_mask_as_it_is(tmp_path):
    # PaddlePaddle/PaddleNLP#4986 (written blind, batch blind-zt; caught before any rule changed for it): the static
    # GPT-3 generation's prefill added the 1/0 prompt mask to the -1e4 causal bias unconverted, so a left-padded
    # prompt's real tokens attended its padding; the decode steps converted it, `(1 - mask) * -1e4`
    check_bug(tmp_path, "paddlenlp_gpt3_static_generation_prefill_mask_not_additive", "padding-unused")
