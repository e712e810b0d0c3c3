"""checks/turned.py: a mask that keeps exactly the padding the batch's lengths (held by the program's own frames) state,
its whole rows seeing no key: the mask read the wrong way round."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

TURNED = Path(__file__).parent / "data" / "turned"


def test_nemo_tts_aligner_text_mask_not_inverted(tmp_path):
    """NeMo#6584: `get_mask_from_lengths(text_len)` (True = real) handed to `masked_fill_(mask, -inf)`: utterance 0
    (whole) sees no phoneme, utterance 1 only its two padded ones; the first cell is a double loop's over text_len."""
    hit = check_bug(tmp_path, "nemo_tts_aligner_text_mask_not_inverted", "lengths-inverted")[0]
    text_len = [6, 4]
    assert tuple(hit["cell"]) == first((2, 10, 6), lambda b, q, k: text_len[b] < 6 and k >= text_len[b])
    assert "text_len" in hit["message"] and "[4, 5]" in hit["message"]


def test_left_padding_mask_handed_to_sdpa_as_keep_mask(tmp_path):
    """Written another way: left-padded `seq_lens` in a helper function, the padding (True = padding) handed to SDPA,
    which reads True = may attend, 4-D, two layers; the first cell is a double loop's over the left-padded lengths."""
    status, found, report = traced(tmp_path, "sdpa_left_padding_mask_as_keep_mask", False, TURNED)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "lengths-inverted")
    assert hit["severity"] == "wrong"
    seq_lens, length = [3, 7, 5], 7
    assert tuple(hit["cell"]) == first((3, 7, 7), lambda b, q, k: seq_lens[b] < length and k < length - seq_lens[b])
    status, found, report = traced(tmp_path, "sdpa_left_padding_mask_as_keep_mask", True, TURNED)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_quiet_where_the_lengths_are_kept_to(tmp_path):
    """The fixes of both, and a held-padding program whose mask keeps to its lengths: no lengths-inverted."""
    for name, folder in (("nemo_tts_aligner_text_mask_not_inverted", None), ("sdpa_left_padding_mask_as_keep_mask", TURNED)):
        _, found, report = traced(tmp_path, name, True, *(() if folder is None else (folder,)))
        assert not [f for f in found if f["code"] == "lengths-inverted"], report


def test_quiet_on_a_left_padded_row_half_padding_whose_whole_row_sees_every_key(tmp_path):
    """Read right-padded, the correct left-padded mask of a row of 3 real keys in 6 keeps exactly that reading's
    padding; the whole row sees every key, which no turned mask does: quiet, both forms."""
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "left_padded_half_rows_kept", fixed, TURNED)
        assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_lengths_held_as_a_numpy_array_a_list_or_a_tuple_are_read_as_a_tensors_are(tmp_path):
    """hunt 9: the batch's lengths held as numpy / list / tuple (not a tensor) state the same padding: the padding
    mask handed where True = may attend is lengths-inverted, and the first cell is a double loop's over the lengths;
    the fix is quiet."""
    seq_lens, length = [3, 6, 5], 6
    for held in ("numpy", "list", "tuple"):
        hit = check_bug(tmp_path, "lengths_not_a_tensor", "lengths-inverted", TURNED, ("--as", held))[0]
        assert "seq_lens" in hit["message"], hit
        assert tuple(hit["cell"]) == first((3, 6, 6), lambda b, q, k: seq_lens[b] < length and k >= seq_lens[b])


def test_lengths_held_as_a_huge_list_or_array_cost_no_loop_and_are_not_read():
    """A list or array of more lengths than any batch (over held.MOST) is not read, and its size alone is asked: a
    list of 10^7 items is refused at once (no conversion, no Python loop over it)."""
    import time

    import numpy as np

    from maskcli.trace import held

    class Code:
        co_name, co_filename = "f", "p.py"

    huge, array = [1] * 10_000_000, np.ones(10_000_000, dtype=np.int64)
    started = time.process_time()
    assert held._lengths_given("seq_lens", huge, Code) is None
    assert held._lengths_given("seq_lens", array, Code) is None
    assert time.process_time() - started < 0.05
    assert held._lengths_given("seq_lens", (4, 2), Code)["rows"].tolist() == [4, 2]
    assert held._lengths_given("lens", [0.5, 1.0], Code)["kind"] == "relative"
    for odd in ([], ["3", "4"], [True, False], [[1, 2], [3]], (2, object(), 3), np.ones((2, 2), dtype=int)):
        assert held._lengths_given("seq_lens", odd, Code) is None, odd


def test_lengths_a_script_keeps_at_its_top_level_are_read(tmp_path):
    """A script's top-level `lengths = [6, 4, 5]` states the batch (trace/held.py reads a script's globals named as
    lengths or a padding mask): nn.TransformerEncoder handed `arange < lengths` as src_key_padding_mask (True = padding
    to MHA) keeps exactly the padding; the first cell is a double loop's over the lengths; the fix is quiet."""
    name = "encoder_top_level_lengths_key_padding_true_on_tokens"
    hit = check_bug(tmp_path, name, "lengths-inverted", TURNED)[0]
    lengths, length = [6, 4, 5], 6
    assert "`lengths` in <module>()" in hit["message"], hit
    assert tuple(hit["cell"]) == first((3, 6, 6), lambda b, q, k: lengths[b] < length and k >= lengths[b])


def test_top_level_lengths_tensor_viewed_per_row_in_eval(tmp_path):
    """Written another way (a new user's first try): the lengths a tensor at the script's top level, viewed per batch
    row (`lengths[:, None]`, all of the batch: read as the padding's statement) into the encoder's key padding mask,
    eval without grad (MHA's fast path); the first cell is a double loop's over the lengths; the fix is quiet."""
    name = "encoder_eval_lengths_tensor_key_padding_true_on_tokens"
    hit = check_bug(tmp_path, name, "lengths-inverted", TURNED)[0]
    lengths, length = [6, 4], 6
    assert "`lengths` in <module>()" in hit["message"], hit
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: lengths[b] < length and k >= lengths[b])


def test_navit_key_pad_mask_inverted(tmp_path):
    """lucidrains/vit-pytorch commit 96f66d2 (issue lucidrains/vit-pytorch#306): NaViT's `key_pad_mask = lengths <=
    arange` is True on the padding, and-ed into the per-image block mask: the full group (24 patches) sees no key, the
    other (12 patches) only its padded tail. The first cell is a double loop's over the groups' lengths."""
    hit = check_bug(tmp_path, "vit_pytorch_navit_key_pad_mask_inverted", "lengths-inverted")[0]
    lengths, length = [24, 12], 24
    assert "`lengths`" in hit["message"], hit
    assert tuple(hit["cell"]) == first((2, 24, 24), lambda b, q, k: lengths[b] < length and k >= lengths[b])


def test_packed_images_sdpa_key_mask_reversed(tmp_path):
    """Written another way: a collate's F.pad, image ids padded with -1, `seq_lens`, the keep mask handed to SDPA with
    `arange >= seq_lens` (True on padding); the first cell is a double loop's over seq_lens (a padded row's first
    padded key; the full row 0 sees nothing); the fix is quiet."""
    hit = check_bug(tmp_path, "packed_images_sdpa_key_mask_reversed", "lengths-inverted", TURNED)[0]
    seq_lens, length = [10, 5, 6], 10
    assert "`seq_lens`" in hit["message"], hit
    assert tuple(hit["cell"]) == first((3, 10, 10), lambda b, q, k: seq_lens[b] < length and k >= seq_lens[b])
