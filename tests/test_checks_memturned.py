"""checks/memturned.py: a cross-attention that sees only the memory keys its own encoder masked as padding."""

from __future__ import annotations

from checkbugs import caught, check_bug, first, traced


def test_3d_molm_q_former_reads_uni_mols_padding_mask_as_its_encoder_attention_mask(tmp_path):
    """lsh0520/3D-MoLM#8 (written blind): Uni-Mol's padding_mask (True = padding) handed on as BERT's
    encoder_attention_mask (1 = attend): the learned queries of the 4-atom molecule see its padding atoms only."""
    hit = check_bug(tmp_path, "molm3d_qformer_unimol_padding_mask_as_encoder_attention_mask", "memory-padding-inverted")[0]
    assert tuple(hit["cell"]) == (1, 0, 4) and "graph_encoder.attn" in hit["message"]


def test_an_mha_cross_attention_handed_the_real_tokens_as_its_key_padding_mask(tmp_path):
    """The same slip through nn.MultiheadAttention (True = padding both sides), no lengths named: the encoder's
    src_key_padding_mask says the padding, the cross-attention is handed its complement."""
    hit = caught(tmp_path, "mha_memory_padding_turned", ("memory-padding-inverted",))
    sizes = [6, 4, 3]
    # the first cell (row, query, key) where a query of a padded row sees a key past its memory's length, by a loop
    # over what nn.MultiheadAttention does with key_padding_mask = (k < size): it hides the real keys
    expected = first((3, 2, 6), lambda b, q, k: sizes[b] < 6 and not k < sizes[b])
    assert tuple(hit["cell"]) == expected


def test_muse_maskgit_context_mask_keeps_the_zeroed_caption_padding_beside_its_null_key(tmp_path):
    """lucidrains/muse-maskgit-pytorch 83aea2d (written blind, round 51): `torch.any(text_embeds == 0, dim=-1)` keeps the
    T5 caption's zeroed padding rows, and a learned null key is prepended to the keys: the image tokens see the null
    key and the caption's pads, none of its words (the T5 encoder's own mask states which are pads)."""
    hit = check_bug(tmp_path, "muse_maskgit_text_context_mask_keeps_padding_only", "memory-padding-inverted")[0]
    caption = [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]  # the program's T5 attention_mask
    # the first cell where an image token sees a caption pad, key 0 being the null key, by a loop
    expected = first((2, 16, 9), lambda b, q, k: k >= 1 and caption[b][k - 1] == 0)
    assert tuple(hit["cell"]) == expected
    assert "1 key of the attention's own before the memory's left out" in hit["message"]


def test_memory_tokens_appended_after_the_frames_beside_a_turned_padding_mask(tmp_path):
    """Written another way: nn.TransformerEncoder's src_key_padding_mask (True = padding) handed to SDPA's bool mask
    (True = attend) by a cross-attention that appends 2 memory tokens after the frames."""
    hit = caught(tmp_path, "cross_attention_memory_tokens_appended_padding_mask_turned", ("memory-padding-inverted",))
    lengths = [7, 4, 5]
    expected = first((3, 9, 9), lambda b, q, k: k < 7 and k >= lengths[b])
    assert tuple(hit["cell"]) == expected
    assert "2 keys of the attention's own after the memory's left out" in hit["message"]


def test_a_cross_attention_that_sees_real_memory_keys_too_is_left_alone(tmp_path):
    """A decoder whose memory mask is one key short of its encoder's padding sees a padding key and the real keys:
    another slip, not this rule's (the mask is not turned round)."""
    program = tmp_path / "unmasked.py"
    program.write_text(UNMASKED)
    status, found, report = traced(tmp_path, "unmasked", False, tmp_path)
    assert [f for f in found if f["code"] == "memory-padding-inverted"] == [], report


UNMASKED = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.cross = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, source, pad, short, target):
        memory = self.encoder(source, src_key_padding_mask=pad)
        return self.cross(target, memory, memory, key_padding_mask=short, need_weights=False)[0]


pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
short = torch.tensor([[False] * 5, [False, False, False, False, True]])
with torch.no_grad():
    Model().eval()(torch.randn(2, 5, 8), pad, short, torch.randn(2, 3, 8))
'''


def test_a_decoders_causal_self_attention_is_not_read_as_the_memorys_encoder(tmp_path):
    """A left-padded source and a right-padded target as long as it (fairseq's default sides): the cross-attention sees
    the source's real keys, which in one row are exactly the target's padding; the decoder's causal self-attention,
    the last square call before it, is not the encoder whose padding it keeps to."""
    program = tmp_path / "sides.py"
    program.write_text(SIDES)
    status, found, report = traced(tmp_path, "sides", False, tmp_path)
    assert [f for f in found if f["code"] == "memory-padding-inverted"] == [], report


SIDES = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, source, source_pad, target, target_pad):
        memory = self.encoder(source, src_key_padding_mask=source_pad)
        causal = nn.Transformer.generate_square_subsequent_mask(target.shape[1]) < 0
        return self.decoder(target, memory, tgt_mask=causal, tgt_key_padding_mask=target_pad,
                            memory_key_padding_mask=source_pad)


source_pad = torch.tensor([[False] * 5, [True, True, True, False, False]])
target_pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
with torch.no_grad():
    Model().eval()(torch.randn(2, 5, 8), source_pad, torch.randn(2, 5, 8), target_pad)
'''


def test_transformers_t5_beam_search_over_padded_sources_is_quiet(tmp_path):
    """quiet-u (written blind, correct): T5's generate with num_beams=3 over a padded batch of 3 sources, then each
    source alone. Beam search repeats each encoder row per beam, so the cross-attention has 9 (then 3) rows: its memory's
    padding is the latest encoder run's (1 or 3 rows) expanded, not an older encoder run's that happens to have as many
    rows (the first batch's 3 rows read against the lone first source's 3 beams said encoder-padding-ignored)."""
    from pathlib import Path

    folder = Path(__file__).parent / "data" / "quiet_blind"
    status, found, report = traced(tmp_path, "hf_t5_padded_encoder_inputs_beam_search_generate", False, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_an_encoders_padding_expanded_per_beam_or_tiled_as_the_memory_mask_says():
    """_expanded: each encoder row repeated (transformers' repeat_interleave) or the batch tiled, the same where only one
    row; where they differ, the one the model call's own memory mask states, else nothing."""
    import numpy as np

    from maskcli.checks.context import Top
    from maskcli.checks.memturned import Encoded, _expanded

    real = np.array([[1, 1, 0], [1, 1, 1]], dtype=bool)
    each = np.repeat(real, 2, axis=0)  # rows 0, 0, 1, 1
    tiled = np.concatenate([real, real])  # rows 0, 1, 0, 1
    encoded = Encoded(real, "encoder.0.attn", True)
    assert np.array_equal(_expanded(Encoded(real[:1], "e", True), None, 3).real, np.repeat(real[:1], 3, axis=0))
    assert _expanded(encoded, Top("T5", None, {}, 0, 1), 4) is None  # (which way: not stated)
    said = Top("T5", None, {"attention_mask": each.astype(np.int64)}, 0, 1)
    assert np.array_equal(_expanded(encoded, said, 4).real, each)
    said = Top("T5", None, {"encoder_attention_mask": tiled.astype(np.int64)}, 0, 1)
    assert np.array_equal(_expanded(encoded, said, 4).real, tiled)


def test_an_unpadded_source_after_a_padded_one_of_as_many_keys_is_quiet(tmp_path):
    """quiet-zk, written another way (BART's left-padded batch in quiet_blind is the first): Marian sources padded on
    the right to max_length 8, one request at a time, each checked against itself alone. The second source fills all
    8 slots: its encoder states no padding, and its cross-attention was read against the first source's encoder (5 of
    the same 8 keys padded; encoder-padding-ignored). The memory's padding is the latest encoder run's."""
    import pytest

    pytest.importorskip("transformers")
    from pathlib import Path

    folder = Path(__file__).parent / "data" / "quiet"
    status, found, report = traced(tmp_path, "marian_max_length_padded_sources_one_at_a_time", False, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report



def test_a_memory_of_two_encoder_runs_adapted_outside_the_model_is_read_by_neither(tmp_path):
    """Correct: captions, then negative captions (one caption twice), encoded in two calls, each output passed through
    the pipeline's own Linear (no memory row copies an encoder output row: checks/memrows.py maps none), expanded per
    image with its own mask and handed to a DiT as [negative; positive]. The latest encoder run's rows repeated would
    call the positive rows' real tokens padding (main said encoder-padding-ignored at row 4); two encoder runs back to
    back read as neither (memrows.encoder_runs). No finding that is wrong or suspicious."""
    from pathlib import Path

    from checkbugs import traced

    status, found, report = traced(tmp_path, "cfg_adapted_captions_encoded_apart_quiet", False,
                                   Path(__file__).parent / "data" / "memory")
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
