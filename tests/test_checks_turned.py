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
