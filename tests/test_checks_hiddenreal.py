"""checks/hiddenreal.py: real-keys-hidden, a self-attention's key mask hiding real tokens the lengths the program
holds call real (trace/held.py's (B, k) length columns and 1-D lengths)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first

HIDDENREAL = Path(__file__).parent / "data" / "hiddenreal"


def _first_hidden(lengths: list[int], prefix: list[int], length: int) -> tuple[int, int, int]:
    """The reference: the first (row, query, key) where a real key of a right-padded row is one of its prefix tokens
    that the buggy mask hides, in a row whose padding does not touch them (a padded row with a prefix), by loops."""
    def bad(b, q, k):
        return lengths[b] < length and k < prefix[b] <= lengths[b] and q < lengths[b]
    return first((len(lengths), length, length), bad)


def test_sockeye_encoder_masks_prepended_source_tokens(tmp_path):
    """awslabs/sockeye 60adf20d (PR #1087; written blind, batch blind-dh): prepare_source_length_mask defaulted to
    mask_prepended_tokens=True, so the encoder's self-attention hid every prepended source token; valid_length holds
    (total, prepended) per row. Fix quiet."""
    hit = check_bug(tmp_path, "sockeye_transformer_encoder_masks_prepended_source_tokens", "real-keys-hidden")[0]
    assert "valid_length" in hit["source"] and "valid_length[:, 0] right-padded" in hit["message"]
    assert tuple(hit["cell"]) == _first_hidden([10, 8, 12], [4, 3, 0], 12)


def test_prefix_tags_hidden_by_a_shared_padding_helper(tmp_path):
    """Written another way: 1-D src_lengths beside prefix_lengths, nn.MultiheadAttention's key_padding_mask (True =
    padding) from a helper shared with the cross-attention, a row unpadded whose tags alone are hidden. Fix quiet."""
    hit = check_bug(tmp_path, "encoder_prefix_tags_masked_by_shared_padding_helper", "real-keys-hidden", HIDDENREAL)[0]
    assert "src_lengths" in hit["source"]
    assert tuple(hit["cell"]) == _first_hidden([9, 7, 5], [2, 1, 2], 9)


def test_the_rule_reads_every_way_the_lengths_lie():
    """A mask that only reads shorter lengths (hidden keys one run with the padding) is no finding; one hiding a prefix
    of a padded row is; a reading the mask accounts for quiets the others."""
    from maskcli.checks.hiddenreal import _columns, _read_against

    at = np.arange(6)
    real = np.stack([at < 6, at < 4])
    shorter = np.broadcast_to(np.stack([at < 6, at < 3])[:, None, :], (2, 6, 6))  # keys 3.. hidden: lengths 6, 3
    assert _read_against(shorter, real) is True
    prefix = np.broadcast_to(np.stack([at >= 0, (at >= 1) & (at < 4)])[:, None, :], (2, 6, 6))
    assert _read_against(prefix, real) == (1, 0)
    slots = ((at % 3) != 0)[None, None, :] & real[:, None, :] & np.ones((2, 6, 1), bool)  # keys 0, 3 hidden
    assert _read_against(slots, real) == (0, 0)
    slots[:, [0, 3], :] = False  # (and those positions see no key as queries: slots laid between tokens, no token)
    assert _read_against(slots, real) is True
    held = {"kind": "columns", "name": "valid_length", "rows": np.array([[6, 1], [4, 1]])}
    assert [name for name, _ in _columns(held, 6)] == ["valid_length[:, 0] right-padded", "valid_length[:, 0] left-padded"]


def test_e2_tts_sample_mask_excludes_audio_prompt(tmp_path):
    """lucidrains/e2-tts-pytorch 90bb536 (reverting 24474eb; written blind, batch blind-es): E2TTS.sample did
    `mask &= ~cond_mask`, so no frame attends to the voice prompt; `duration` (24, 20) holds each sample's frames and
    `lens` (10, 7) its prompt's. Fix quiet."""
    hit = check_bug(tmp_path, "e2_tts_pytorch_sample_attention_mask_excludes_audio_prompt", "real-keys-hidden")[0]
    assert "duration" in hit["source"] and "duration right-padded" in hit["message"]
    assert tuple(hit["cell"]) == _first_hidden([24, 20], [10, 7], 24)


def test_prompt_frames_or_ed_into_mha_key_padding(tmp_path):
    """Written another way: nn.MultiheadAttention's key_padding_mask (True = padding) from `durations` OR-ed with the
    prompt frames, three rows, two padded. Fix quiet."""
    hit = check_bug(tmp_path, "prompt_frames_in_key_padding_mask_mha_durations", "real-keys-hidden", HIDDENREAL)[0]
    assert "durations" in hit["source"]
    assert tuple(hit["cell"]) == _first_hidden([17, 20, 13], [5, 8, 6], 20)


def test_streaming_chunk_slots_the_lengths_count_are_no_hidden_real_keys(tmp_path):
    """modelscope/FunASR's SANMEncoderChunkOpt (blind-fe): split_chunk lays look-back slots between each chunk's frames
    and its `ilens` counts them; the chunk mask hides those slots as keys and as queries (rows that see nothing, zeroed
    after the softmax). No real key is hidden: the fixed program is quiet of real-keys-hidden."""
    from checkbugs import traced

    blind = Path(__file__).parent / "data" / "blind"
    name = "funasr_paraformer_online_dynamic_chunk_never_trains_last_chunk_config"
    status, found, report = traced(tmp_path, name, True, blind)
    assert [f for f in found if f["code"] == "real-keys-hidden"] == [], report
    assert status == 0, report
