"""checks/memorypads.py: a cross-attention whose every query sees only the memory's padding (the source's mask
inverted once too often), against the padding the model call states; the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first

MEMORYPADS = Path(__file__).parent / "data" / "memorypads"


def test_nemo_t5_complete_inverts_the_encoder_mask_twice(tmp_path):
    """NVIDIA/NeMo#3838 (written blind): `complete()` inverts the encoder mask before the module inverts it again; a
    batch of one prompt padded to 12 with the pad id 0 of the tokenizer the model holds (`self.tokenizer.pad_id`)."""
    found = check_bug(tmp_path, "nemo_megatron_t5_complete_encoder_mask_inverted_twice", "memory-padding-only-attended")
    ids = [5, 9, 13, 17, 3, 21, 25, 0, 0, 0, 0, 0]
    assert tuple(found[0]["cell"]) == first((1, 1, 12), lambda b, q, k: ids[k] == 0)
    assert "pad id 0 of self.tokenizer (Tokenizer) in decode()" in found[0]["message"]


def test_pad_ids_handed_to_sdpa_as_its_keep_mask_over_the_memory(tmp_path):
    """Written another way: two sources padded to a fixed length (no row whole) by a tokenizer stand-in's
    pad_token_id, SDPA handed `ids == pad` (True = may attend) over the memory."""
    found = check_bug(tmp_path, "cross_attention_pad_ids_as_keep_mask", "memory-padding-only-attended", folder=MEMORYPADS)
    ids = [[4, 5, 6, 7, 8, 2, 0, 0], [4, 11, 12, 2, 0, 0, 0, 0]]
    assert tuple(found[0]["cell"]) == first((2, 1, 8), lambda b, q, k: ids[b][k] == 0)


def test_a_fixed_length_reading_needs_the_tokenizers_pad_id_apart_from_its_eos():
    """_fixed_length: ids at the tokenizer's pad id, a run at an edge of each row leaving a real token; none where
    the pad id is the EOS (it may end a real sequence), a pad run sits inside a row, or a row is all padding."""
    import numpy as np

    from maskcli.checks.memorypads import _fixed_length

    ids = np.array([[4, 5, 0, 0], [0, 6, 7, 8]])
    real, source, sure = _fixed_length({"input_ids": ids, "tokenizer_pad_id": 0, "tokenizer": "tok"}, 2, 4)
    assert real.tolist() == [[k < 2 for k in range(4)], [k > 0 for k in range(4)]] and sure
    assert _fixed_length({"input_ids": ids, "tokenizer_pad_id": 0, "tokenizer_eos_id": 0}, 2, 4) is None
    assert _fixed_length({"input_ids": np.array([[4, 0, 5, 6]]), "tokenizer_pad_id": 0}, 1, 4) is None
    assert _fixed_length({"input_ids": np.array([[0, 0, 0, 0]]), "tokenizer_pad_id": 0}, 1, 4) is None
