"""checks/sides.py: each side of a seq2seq model read against its own pad id; real queries that see no key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug, first, traced
from maskcli.checks.context import Top
from maskcli.checks.sides import _side, side_tokens

ARGS = Path(__file__).parent / "data" / "args"


def test_seq2seq_pad_mask_uses_src_pad_idx_for_target(tmp_path):
    """hyunwoongko/transformer#11: the target's pad masks built with the source's pad id."""
    check_bug(tmp_path, "seq2seq_pad_mask_uses_src_pad_idx_for_target", "real-query-blind")


def test_hyunwoongko_make_pad_mask_src_pad_idx_for_target_written_blind(tmp_path):
    """hyunwoongko/transformer#14 (commit 67ccbb0; written blind, batch blind-ew, caught before any rule was changed
    for it): make_pad_mask compared both sides with src_pad_idx, so a target token equal to it (trg_pad_idx != it) sees
    nothing: batch row 0's query 3, a real target token by `trg` at trg_pad_idx."""
    hit = check_bug(tmp_path, "hyunwoongko_transformer_make_pad_mask_uses_src_pad_idx_for_target", "real-query-blind")[0]
    assert "batch row 0: query 3 sees no key" in hit["message"] and "trg_pad_idx" in hit["message"]


def test_target_pad_bias_built_with_the_source_pad_id(tmp_path):
    """hyunwoongko/transformer#14's slip written another way: one pad-bias helper for both axes, an additive bias to
    SDPA, the target's built with src_pad_id (1) where the target's <unk> (id 1) is real; left-padded sources,
    right-padded targets: row 0's query 2, the target token at 1, sees nothing."""
    hit = check_bug(tmp_path, "nmt_target_self_attention_pad_mask_from_source_pad_id", "real-query-blind", ARGS)[0]
    tgt = [[2, 13, 1, 14, 3, 0], [2, 15, 16, 17, 18, 3]]
    blind = [(b, q) for b, row in enumerate(tgt) for q, token in enumerate(row) if token == 1]
    assert f"batch row {blind[0][0]}: query {blind[0][1]} sees no key" in hit["message"]


def test_pad_test_with_the_bos_id(tmp_path):
    """Written another way: one pad id (a config dataclass's pad_token_id), left padding, SDPA, the padding tested with
    the BOS id; the row reported is the first real query a double loop finds with no key."""
    status, found, report = traced(tmp_path, "pad_test_with_bos_id", fixed=False, folder=ARGS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "real-query-blind")
    ids = torch.tensor([[0, 0, 1, 5, 6, 7], [1, 8, 9, 10, 11, 12], [0, 1, 13, 14, 15, 16]])
    kept = (ids != 1)[:, :, None] & (ids != 1)[:, None, :]  # what the buggy program let each query see
    b, q, _ = first((3, 6, 1), lambda b, q, k: bool(ids[b, q] != 0 and not kept[b, q].any()))
    assert hit["severity"] == "wrong" and tuple(hit["cell"]) == (b, q, q)
    status, found, report = traced(tmp_path, "pad_test_with_bos_id", fixed=True, folder=ARGS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_each_side_is_read_with_its_own_pad_id_and_path():
    """A target id equal to the source's pad id is a real word; a pad id inside a row states no padding; the call's side
    is its module path's, else the one side whose length its keys have."""
    top = Top("Model", None, {"src_pad_id": 1, "trg_pad_id": 0, "src": np.array([[5, 1, 1], [4, 6, 7]]),
                              "tgt": np.array([[2, 1, 0, 0], [2, 3, 4, 0]])}, 0, 1)
    real, source = side_tokens(top, "trg")
    assert real.tolist() == [[True, True, False, False], [True, True, True, False]] and "`tgt`" in source
    assert side_tokens(top, "src")[0].tolist() == [[True, False, False], [True, True, True]]
    inside = Top("Model", None, {"trg_pad_id": 0, "trg": np.array([[2, 0, 5]])}, 0, 1)
    assert side_tokens(inside, "trg") is None

    class Call:
        def __init__(self, where, k_len):
            self.where, self.shape = where, (1, 1, k_len, k_len)

    lengths = {"src": 3, "trg": 4}
    assert _side(Call("model.decoder.layers.0.self_attn", 3), lengths) == "trg"
    assert _side(Call("enc_layers.1.attention", 4), lengths) == "src"
    assert _side(Call("blocks.0.attn", 4), lengths) == "trg"
    assert _side(Call("blocks.0.attn", 5), {"src": 5, "trg": 5}) is None


def test_one_pad_statement_and_an_encoder_decoders_attention_mask(monkeypatch):
    """Without per-side pad ids the model call's attention_mask is the statement: a real query with no key is found,
    and the same cells are left alone where the config says the model is an encoder-decoder (its encoder's mask)."""
    from maskcli.checks import sides

    cells = np.tril(np.ones((3, 3), dtype=bool))[None, None].copy()
    cells[0, 0, 1] = False  # query 1 sees nothing

    class Call:
        index, where, step, api, details, mask, stored = 0, "layers.0.attn", 0, "sdpa", {}, "m", {"form": "dense"}
        shape = (1, 1, 3, 3)

    class EncoderDecoder:
        is_encoder_decoder = True

    monkeypatch.setattr(sides, "keep", lambda call: cells)
    arguments = {"attention_mask": np.array([[1, 1, 1]])}
    run = sides.Run([Call()], [Top("Model", None, arguments, 0, 1)], [])
    (_, finding), = sides.sides(run)
    assert finding.code == "real-query-blind" and finding.cell == (0, 1, 1)
    run = sides.Run([Call()], [Top("Model", EncoderDecoder(), arguments, 0, 1)], [])
    assert sides.sides(run) == []


def test_verl_rm_dataset_chosen_mask_from_rejected_ids(tmp_path):
    """verl-project/verl#1411: RMDataset stacks the rejected row's token ids as the chosen row's attention_mask (batch
    blind-af); written blind and caught before any rule was changed for it. The fix is quiet."""
    check_bug(tmp_path, "verl_rm_dataset_chosen_mask_from_rejected_ids", "real-query-blind")


def test_a_time_major_source_is_read_turned_only_where_asked_for_its_batch_first_shape():
    """side_tokens with the (B, L) a call reads: tokens handed (L, B) are turned; asked for nothing, or for a shape the
    tokens have as they are, they are read as they are."""
    src = np.array([[5, 6], [7, 1], [8, 1]])  # [src len 3, batch 2]: row 1 padded with 1 after its first token
    top = Top("Seq2Seq", None, {"src": src, "src_pad_id": 1}, 0, 1)
    real, source = side_tokens(top, "src", (2, 3))
    assert real.tolist() == [[True, True, True], [True, False, False]] and "time-major" in source
    assert side_tokens(top, "src")[0].shape == (3, 2) and "time-major" not in side_tokens(top, "src")[1]
    assert side_tokens(top, "src", (3, 2))[0].shape == (3, 2)


def test_real_queries_whose_scores_are_nan_are_said_by_the_nan_not_as_blind(tmp_path):
    """PatchTST's residual attention over right-padded series (tests/data/quiet_blind, written as correct; it is not):
    a band of +-2 patches leaves a pad patch no key, its NaN row carried into the next layers, where the real queries'
    scores are NaN. No mask hid their keys: nan-spread says it, real-query-blind (which reads NaN cells as no key
    seen) does not. The NaN rows against the program's own padding: batch row 1 (4 real patches of 7)."""
    status, found, report = traced(tmp_path, "patchtst_key_padding_residual_attention", False,
                                   Path(__file__).parent / "data" / "quiet_blind")
    assert status == 1, report
    assert {f["code"] for f in found if f["severity"] == "wrong"} == {"nan-spread"}, report
    spread = next(f for f in found if f["code"] == "nan-spread")
    assert "query rows 0-5 of batch row 1" in spread["message"]


SIDES = Path(__file__).parent / "data" / "sides"


def _first_blind(trg_input: list, trg_output: list, pad: int) -> tuple[int, int, int] | None:
    """The first real query (trg_input != pad) that sees no key under the buggy mask: the output's padding on the query
    axis ANDed with causal, by a double loop over absolute positions."""
    for b, (inp, out) in enumerate(zip(trg_input, trg_output)):
        for q in range(len(inp)):
            if inp[q] != pad and not any(out[q] != pad and k <= q for k in range(len(inp))):
                return (b, q, q)
    return None


def test_joeynmt_trg_mask_from_the_shifted_target_on_the_query_axis(tmp_path):
    """joeynmt 7ac46a9 (written blind, batch blind-fs): Batch built trg_mask from the shifted output `trg` on the query
    axis, (B, T, 1), ANDed with subsequent_mask: the EOS input of the short sentence (a real token of `trg_input`, the
    target embedding's padding_idx 1 says so) sees no key, its -1e9 row uniform over every key, later ones included."""
    pad, trg = 1, [[2, 13, 14, 15, 16, 17, 3], [2, 18, 19, 3, 1, 1, 1]]
    hit = check_bug(tmp_path, "joeynmt_batch_trg_mask_from_shifted_target_on_query_axis", "real-query-blind")[0]
    assert tuple(hit["cell"]) == _first_blind([t[:-1] for t in trg], [t[1:] for t in trg], pad), hit
    assert "`trg_input` of Model at its pad id 1" in hit["message"], hit["message"]


def test_an_sdpa_seq2seq_whose_tgt_mask_is_the_shifted_output_on_the_query_axis(tmp_path):
    """Written another way: SDPA with an additive finfo.min mask, a dataclass config's pad id 0 held as `tgt_pad_idx`,
    three rows, its modules named `decoder_self_attn` (a word of the path's, read as the target side): the mask from
    `tgt_output` on the query axis blinds each shorter row's EOS input. The fix (key axis, from `tgt_input`) is quiet."""
    tgt = [[1, 14, 15, 16, 17, 2], [1, 18, 2, 0, 0, 0], [1, 19, 20, 21, 2, 0]]
    hit = check_bug(tmp_path, "seq2seq_sdpa_tgt_mask_from_shifted_output_on_query_axis", "real-query-blind", SIDES)[0]
    assert tuple(hit["cell"]) == _first_blind([t[:-1] for t in tgt], [t[1:] for t in tgt], 0), hit
    assert "(2 such rows)" in hit["message"], hit["message"]


def test_padded_query_rows_that_see_nothing_are_quiet(tmp_path):
    """Correct, the same shape: the decoder input's padding on both axes and causal; its padded query rows see no key
    (a note), every real one sees itself: no wrong or suspicious finding."""
    status, found, report = traced(tmp_path, "seq2seq_sdpa_tgt_mask_padding_on_both_axes_quiet", False, SIDES)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_seq2seqs_first_ids_beside_its_target_ids_are_not_read_on_its_decoder(tmp_path):
    """ai-glimpse/toynlp#52 (written blind, batch blind-iv): `TransformerModel.forward(source_token_ids,
    target_token_ids)`, its target pad mask laid on the query axis. Its first argument is the source: the decoder's
    self-attention and its logits are over the target's 6 tokens, and row 0's source (6 real tokens) is no statement
    of them, so neither real-query-blind (its target pads 4-5 see nothing: they are pads) nor pooled-at-padding (the
    program prints `logits[:, -1]`) may read it there. Before and after the fix, no finding is wrong."""
    blind = Path(__file__).parent / "data" / "blind"
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "toynlp_transformer_target_pad_mask_on_query_axis", fixed, blind)
        assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
