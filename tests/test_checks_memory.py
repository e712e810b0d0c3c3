"""checks/memory.py: a cross-attention against the encoder padding the model call states."""

from __future__ import annotations

from checkbugs import BUGS, first, traced
from pathlib import Path
import pytest

from maskcli.checks.context import Run, Top
from maskcli.checks.memory import memory

ARGS = Path(__file__).parent / "data" / "args"
ENCODED = Path(__file__).parent / "data" / "encoded"


def test_gpt2_cross_attention_drops_encoder_mask(tmp_path):
    """huggingface/transformers#47946: encoder_attention_mask overwritten with None before the cross mask is built."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "gpt2_cross_attention_drops_encoder_mask", "encoder-padding-ignored")[0]
    # (what made the call a cross-attention, as checks/context.crossing read it: the memory GPT2Attention was handed)
    assert hit["message"].endswith("(a cross-attention: encoder_hidden_states handed to GPT2Attention.forward() of "
                                   "gpt2_cross_attention_drops_encoder_mask.py)"), hit["message"]


def test_pixart_alpha_caption_never_trimmed_to_its_real_tokens(tmp_path):
    """huggingface/diffusers#5695 (78be400761; written blind, blind-nj, caught before any rule changed for it): PixArt
    hands its transformer no text mask and trims the caption to its real tokens instead, behind a test that could never
    be true after the embeddings were computed; every image token cross-attends all 120 T5 positions. Row 0 is the
    classifier-free guidance's empty negative prompt (its EOS alone is real), so its first padding key is key 1."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "diffusers_pixart_alpha_mask_feature_never_applied_padded_t5_attended",
                    "encoder-padding-ignored")[0]
    assert tuple(hit["cell"]) == (0, 0, 1) and "T5EncoderModel" in hit["message"], hit["message"]


def test_t5_export_wrappers_drop_the_encoder_padding(tmp_path):
    """huggingface/optimum-executorch#230 (written blind, batch blind-aw): the export wrappers ran the T5 encoder over a
    static-length input padded with the pad id 0 and the decoder without encoder_attention_mask."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "optimum_executorch_t5_encoder_padding_mask_dropped", "encoder-padding-ignored")[0]
    assert hit["cell"] == [0, 0, 6], hit  # (the prompt is 6 tokens; key 6 is the first pad)


def test_an_engine_decoder_cross_attending_a_static_length_source_without_its_mask(tmp_path):
    """NVIDIA/TensorRT-Model-Connect cc55eb1 (written blind, batch blind-cr): BART's decoder layer cross-attends all
    24 rows of a source padded to max_source_length (`cross_k` handed to DecLayer.forward, its mask never applied); one
    batch row, so the padding is read off the encoder's own mask, keys no query sees."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "trtmc_bart_decoder_cross_attention_no_encoder_padding_mask", "encoder-padding-ignored")[0]
    real = 7 + 2  # (the source's 7 ids between BOS and EOS; rows past them are the pad id's)
    assert tuple(hit["cell"]) == first((1, 1, 24), lambda b, q, k: k >= real), hit
    assert "cross_k handed to DecLayer.forward()" in hit["message"]


def test_a_decoder_handed_cross_hidden_states_that_drops_their_key_mask(tmp_path):
    """Written another way: two sources padded to one static length, an eager softmax over `cross_hidden_states`,
    the whole target teacher-forced; the first flagged cell is a double loop's over the sources' lengths."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "static_source_decoder_cross_states_unmasked", "encoder-padding-ignored", ENCODED)[0]
    lengths = (5, 9)
    assert tuple(hit["cell"]) == first((2, 6, 12), lambda b, q, k: k >= lengths[b]), hit


def test_memory_key_padding_mask_not_passed(tmp_path):
    """Written another way: nn.TransformerDecoder, memory left-padded and stated True = padding, never handed on; the
    first cell reported is the first a double loop finds over the stated padding (the call has no mask)."""
    import torch

    status, found, report = traced(tmp_path, "memory_padding_not_passed", fixed=False, folder=ARGS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "encoder-padding-ignored")
    assert hit["severity"] == "wrong"
    padded = torch.tensor([[True, True, False, False], [False] * 4, [True, False, False, False]])
    assert tuple(hit["cell"]) == first((3, 7, 4), lambda b, q, k: bool(padded[b, k]))
    assert "(a cross-attention: keys from another input than its queries (4 keys, 7 queries))" in hit["message"]
    status, found, report = traced(tmp_path, "memory_padding_not_passed", fixed=True, folder=ARGS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


class _Call:
    def __init__(self, cells, index=0):
        import numpy as np

        self.index, self.where, self.step, self.api = index, "decoder.0.encoder_attn", 0, "sdpa"
        self.shape = cells.shape
        self.details = {}
        self.mask = "m"
        self.stored = {"form": "dense"}
        self._cells = np.asarray(cells, dtype=bool)


def _run(cells, arguments, config=None, monkeypatch=None):
    import maskcli.checks.memory as module

    call = _Call(cells)
    monkeypatch.setattr(module, "keep", lambda c: c._cells)
    return Run([], [Top("Model", config, arguments, 0, 1)], [call])


def test_against_nn_multihead_attention(monkeypatch):
    """The mask nn.MultiheadAttention builds from a key_padding_mask is quiet; the same keys unmasked for one batch row
    are found at the cell a double loop gives."""
    import numpy as np
    import torch

    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True)
    _, weights = mha(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4), key_padding_mask=pad)
    cells = (weights > 0).detach().numpy()[:, None]  # (2, 1, 3, 5): what MHA let each query see
    arguments = {"memory_key_padding_mask": pad.numpy().astype(np.int64)}
    assert memory(_run(cells, arguments, monkeypatch=monkeypatch)) == []
    leaky = cells.copy()
    leaky[0, :, 1, :] = True
    (_, finding), = memory(_run(leaky, arguments, monkeypatch=monkeypatch))
    assert finding.cell == first((2, 3, 5), lambda b, q, k: bool(leaky[b, 0, q, k] and pad[b, k]))


def test_encoder_decoder_attention_mask_and_all_padding_row(monkeypatch):
    """An encoder-decoder's attention_mask is its encoder's; a batch row whose memory is all padding is left alone."""
    import numpy as np

    class Config:
        is_encoder_decoder = True

    cells = np.ones((2, 1, 2, 3), dtype=bool)
    arguments = {"attention_mask": np.array([[1, 1, 0], [0, 0, 0]])}
    (_, finding), = memory(_run(cells, arguments, Config(), monkeypatch))
    assert finding.cell == (0, 0, 2)
    assert memory(_run(cells, {"attention_mask": np.array([[1, 1, 1], [0, 0, 0]])}, Config(), monkeypatch)) == []
    assert memory(_run(cells, arguments, None, monkeypatch)) == []  # a decoder-only model's attention_mask is its own


def test_seq2seq_pytorch_soft_dot_attention_ignores_source_mask(tmp_path):
    # MaximumEntropy/Seq2Seq-PyTorch#6: Luong attention's (B, Lk) softmax over padded encoder states, the source's pad
    # id stated by its embedding's padding_idx
    from checkbugs import check_bug

    check_bug(tmp_path, "seq2seq_pytorch_soft_dot_attention_ignores_source_mask", "encoder-padding-ignored")


class _Luong:
    """Written otherwise: matmul and squeeze(-1), a left-padded `src`, the pad id as `src_pad_idx`, F.softmax(dim=-1)."""

    @staticmethod
    def model(masked: bool):
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        class Translator(nn.Module):
            src_pad_idx = 1

            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(9, 6)
                self.encoder = nn.GRU(6, 6, batch_first=True)
                self.cell = nn.GRUCell(6, 6)

            def forward(self, src, steps=3):
                memory, h = self.encoder(self.embed(src))
                h, out = h[0], []
                for _ in range(steps):
                    scores = (memory @ h.unsqueeze(-1)).squeeze(-1)
                    if masked:
                        scores = scores.masked_fill(src == self.src_pad_idx, float("-inf"))
                    weights = F.softmax(scores, dim=-1)
                    context = (weights.unsqueeze(1) @ memory).squeeze(1)
                    h = self.cell(context, h)
                    out.append(context)
                return torch.stack(out, 1), memory, h

        return Translator()


def _luong_traced(masked: bool):
    import torch

    import maskcli
    from maskcli.checks.registry import severity

    torch.manual_seed(0)
    model = _Luong.model(masked)
    src = torch.tensor([[3, 4, 5, 6, 7], [1, 1, 1, 4, 8]])  # row 1 left-padded with the pad id 1
    with maskcli.trace() as t, torch.no_grad():
        out = model(src)
    return [(f.code, severity(f), f.message) for g in t.groups() for f in g.findings], model, src, out


def test_a_luong_attention_over_a_left_padded_source_with_no_mask_is_wrong():
    found, _, src, _ = _luong_traced(False)
    hits = [f for f in found if f[0] == "encoder-padding-ignored"]
    assert len(hits) == 1 and hits[0][1] == "wrong", found
    # the first cell by the reference double loop: batch row, (one) query, a key at the pad id
    cell = first((2, 1, 5), lambda b, q, k: int(src[b, k]) == 1)
    assert f"batch row {cell[0]}: decoder query 0 sees encoder key {cell[2]}" in hits[0][2], hits


def test_a_luong_attention_that_masks_the_source_padding_is_quiet_and_matches_sdpa():
    import torch
    import torch.nn.functional as F

    found, model, src, (contexts, memory, _) = _luong_traced(True)
    assert [f for f in found if f[1] == "wrong"] == [], found
    # the first step's context against SDPA over the same memory with the source padding as a key mask
    with torch.no_grad():
        _, h = model.encoder(model.embed(src))
        q = h[0][:, None, None, :]
        keys = memory[:, None]
        reference = F.scaled_dot_product_attention(q, keys, keys, attn_mask=(src != 1)[:, None, None, :], scale=1.0)
    assert torch.allclose(contexts[:, 0], reference[:, 0, 0], atol=1e-5)


def test_bart_pretrain_padded_batch_without_attention_mask(tmp_path):
    """transformers-bart-pretrain#11: sources padded with the config's pad_token_id, no attention_mask fed: the input
    ids at the pad id state the encoder's padding, which the cross-attention (and the encoder's self-attention,
    arguments.py) attends."""
    pytest.importorskip("transformers")
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "bart_pretrain_padded_batch_without_attention_mask", "encoder-padding-ignored")[0]
    assert "no attention_mask given" in hit["message"]


def test_t5_left_padded_sources_no_attention_mask(tmp_path):
    """Written another way: T5, sources left-padded by hand with pad id 0, labels given; the first cell is a double
    loop's over the decoder queries and the stated source padding; the mask handed in is quiet."""
    pytest.importorskip("transformers")
    status, found, report = traced(tmp_path, "t5_left_padded_sources_no_attention_mask", fixed=False, folder=ARGS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "encoder-padding-ignored")
    assert hit["severity"] == "wrong"
    ids = [[5, 6, 7, 8, 9, 1], [0, 0, 0, 10, 11, 1]]
    assert tuple(hit["cell"]) == first((2, 4, 6), lambda b, q, k: ids[b][k] == 0)
    encoder = next(f for f in found if f["code"] == "padding-ignored")  # (the encoder's self-attention: arguments.py)
    assert tuple(encoder["cell"]) == first((2, 6, 6), lambda b, q, k: ids[b][q] != 0 and ids[b][k] == 0)
    status, found, report = traced(tmp_path, "t5_left_padded_sources_no_attention_mask", fixed=True, folder=ARGS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_dia_cross_attention_attends_text_padding(tmp_path):
    """nari-labs/dia#230: the decoder's cross-attention over the padded text ran with no attn_mask; the text padding is
    stated by the encoder's own self-attention (a segment mask, real with real and padding with padding: Dia's
    create_attn_mask(src, src)), run as a model call of its own before the decoder's, and by the pad id 0 of the ids
    it was handed. The first cell is a double loop's over the prompts' lengths (5 and 9, each twice: the CFG rows)."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "dia_decoder_cross_attention_attends_text_padding", "encoder-padding-ignored")[0]
    lengths = [5, 5, 9, 9]
    assert tuple(hit["cell"]) == first((4, 1, 16), lambda b, q, k: k >= lengths[b])
    assert "the encoder's own self-attention (self_attention) marks as padding" in hit["message"], hit["message"]


def test_greedy_decode_source_mask_left_out(tmp_path):
    """Written another way: an Annotated-Transformer-style seq2seq (softmax attention, masked_fill(mask == 0, -1e9)),
    its source left-padded with a pad id no rule reads, whose greedy decoding hands the decoder no source mask: the
    encoder's self-attention (its own model call) hides the padding; the source attention, a softmax site that masks
    nowhere, sees it. The first cell is a double loop's over the source's pad ids; the fix is quiet."""
    status, found, report = traced(tmp_path, "greedy_decode_source_mask_left_out", fixed=False, folder=ENCODED)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "encoder-padding-ignored")
    assert hit["severity"] == "wrong"
    src = [[1, 1, 5, 6, 7, 8], [4, 9, 3, 2, 7, 5], [1, 1, 1, 3, 4, 6]]
    assert tuple(hit["cell"]) == first((3, 1, 6), lambda b, q, k: src[b][k] == 1)
    status, found, report = traced(tmp_path, "greedy_decode_source_mask_left_out", fixed=True, folder=ENCODED)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report




def _encoder_then_decoder(encoder_mask, cross_mask, src=None):
    """An encoder (SDPA self-attention under `encoder_mask`, (B, L, L) bool or None) run as a model call of its own,
    then a decoder's cross-attention (module path `cross_attn`) under `cross_mask` ((B, Q, L) or None), traced; the
    findings (code, severity, cell) and the cross-attention's output."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import maskcli

    class Attend(nn.Module):
        def forward(self, q, k, mask):
            return F.scaled_dot_product_attention(q, k, k, attn_mask=None if mask is None else mask[:, None])

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.self_attn = nn.Embedding(10, 8), Attend()

        def forward(self, ids, mask):
            x = self.embed(ids)[:, None]
            return self.self_attn(x, x, mask)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.cross_attn = Attend()

        def forward(self, queries, memory, mask):
            return self.cross_attn(queries, memory, mask)

    torch.manual_seed(0)
    encoder, decoder = Encoder(), Decoder()
    rows, length = encoder_mask.shape[0] if encoder_mask is not None else 2, 6
    src = torch.randint(2, 10, (rows, length)) if src is None else src
    with maskcli.trace() as t, torch.no_grad():
        memory = encoder(src, encoder_mask)
        out = decoder(torch.randn(rows, 1, 3, 8), memory, cross_mask)
    from maskcli.checks.registry import severity

    found = [(f.code, severity(f), f.cell) for g in t.groups() for f in g.findings if severity(f) != "note"]
    return found, out, memory


def _segments(lengths, length=6):
    import torch

    keys = torch.arange(length)
    head = keys[None, :] < torch.tensor(lengths)[:, None]
    return head[:, :, None] == head[:, None, :], head


def test_a_segment_encoder_mask_states_the_padding_its_cross_attention_must_hide():
    """A segment mask (real with real, padding with padding) whose runs differ in length between rows, its encoder
    handed ids with no one pad id on either run (nothing says which run is the padding): a cross-attention query that
    sees keys of both runs sees the padding whichever run it is (cell: a double loop's first query seeing both, at the
    second run's first key); one that sees only the first run is quiet."""
    segment, head = _segments([4, 2])
    found, _, _ = _encoder_then_decoder(segment, None)
    hits = [f for f in found if f[0] == "encoder-padding-ignored"]
    assert len(hits) == 1 and hits[0][1] == "wrong", found
    both = lambda b, q, k: k == [4, 2][b]  # noqa: E731 - (every query sees every key: the second run's first key)
    assert hits[0][2] == first((2, 3, 6), both)
    cross = head[:, None, :].expand(2, 3, 6)
    found, _, _ = _encoder_then_decoder(segment, cross)
    assert [f for f in found if f[1] == "wrong"] == [], found


def test_a_cross_attention_over_an_unpadded_or_chunked_memory_is_quiet():
    """Quiet: an encoder with no mask (a memory with no padding) under a full cross-attention; an encoder of fixed
    chunks (two runs of 3 in every row: block-diagonal, not padding) under a full cross-attention; an encoder that
    hides the padding from every query, its cross-attention masked the same way."""
    import torch

    assert [f for f in _encoder_then_decoder(None, None)[0] if f[0] == "encoder-padding-ignored"] == []
    chunks, _ = _segments([3, 3])
    assert [f for f in _encoder_then_decoder(chunks, None)[0] if f[0] == "encoder-padding-ignored"] == []
    real = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    keys = real[:, None, :].expand(2, 6, 6)
    found, _, _ = _encoder_then_decoder(keys, real[:, None, :].expand(2, 3, 6))
    assert [f for f in found if f[1] == "wrong"] == [], found
    found, _, _ = _encoder_then_decoder(keys, None)
    hit = next(f for f in found if f[0] == "encoder-padding-ignored")
    assert hit[1] == "wrong" and hit[2] == first((2, 3, 6), lambda b, q, k: not bool(real[b, k]))


def test_a_memory_mask_from_the_batchs_longest_source_beside_the_encoders_per_row_padding(tmp_path):
    """quic/efficient-transformers abe7288a1's cross-attention half, written another way: nn.Transformer's encoder is
    handed each row's src_key_padding_mask, the decoder a memory_key_padding_mask built from the batch's longest source
    (every token real): the memory mask calls real what the encoder's own self-attention masks as padding. The first
    cell is a double loop's over the per-row lengths; the fix (one mask for both) is quiet."""
    from checkbugs import check_bug

    [hit] = check_bug(tmp_path, "batch_max_length_memory_mask_beside_per_row_source_mask", "encoder-padding-ignored",
                      folder=ENCODED)
    lengths = [10, 6, 8]
    assert tuple(hit["cell"]) == first((3, 5, 10), lambda b, q, k: k >= lengths[b]), hit
    assert "though the memory_key_padding_mask given to Transformer calls it real" in hit["message"], hit


def zero_tile_keys(images, keys: int) -> list[list[int]]:
    """Each row's keys made of tiles (the axes between the batch and the last three) whose values are all exactly 0,
    by a plain loop over the tiles, keys / tiles keys each."""
    import numpy as np

    images = np.asarray(images)
    tiles = images.reshape(images.shape[0], -1, *images.shape[-3:])
    per = keys // tiles.shape[1]
    found = []
    for row in tiles:
        found.append([t * per + j for t, tile in enumerate(row) if all(v == 0 for v in tile.flatten()) for j in range(per)])
    return found


def test_torchtune_tiles_padded_before_the_mask_counted_them(tmp_path):
    """meta-pytorch/torchtune#1836: each image padded to 4 tiles before VisionCrossAttentionMask counted them, so
    the text cross-attends the zero tiles' keys (5 a tile)."""
    from checkbugs import check_bug

    [hit] = check_bug(tmp_path, "torchtune_llama3_2_vision_padded_tiles_attended_by_text", "encoder-padding-ignored")
    zero = [1] + [0, 0, 0]  # the 1-tile image's tiles (1 = holds pixels), padded to 4
    keys = zero_tile_keys([[[[[[v]]] for v in zero]]], 20)[0]
    assert keys == list(range(5, 20)) and hit["cell"] == [0, 0, keys[0]]
    assert "tiles 1-3 of batch row 0 exactly 0" in hit["message"]
    assert "(the call's mask keeps every key)" in hit["message"]  # (an all-True mask handed to SDPA, not none)


def test_image_slots_padded_with_zero_images_and_no_key_padding_mask(tmp_path):
    """Written another way: up to 3 images a sample, the missing slots all-zero, nn.MultiheadAttention handed no
    key_padding_mask (right-padded text: its padding queries left out); the fix's key_padding_mask is quiet."""
    import torch

    folder = Path(__file__).parent / "data" / "tiles"
    status, found, report = traced(tmp_path, "mha_padded_image_slots_cross_attended", False, folder)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "encoder-padding-ignored"]
    images = torch.zeros(2, 3, 3, 8, 8)
    images[0], images[1, 0] = 1.0, 1.0  # the program's counts: 3 images and 1
    keys = zero_tile_keys(images.numpy(), 12)
    assert keys == [[], list(range(4, 12))]
    assert hit["severity"] == "wrong" and hit["cell"] == [1, 0, keys[1][0]], report
    assert "(24 such cells)" in hit["message"]  # (the 3 real queries of row 1 over its 8 padded keys)
    assert "(the call is given no mask at all)" in hit["message"]  # (MHA handed neither mask)
    status, found, report = traced(tmp_path, "mha_padded_image_slots_cross_attended", True, folder)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_mead_luong_attention_over_a_time_major_padded_source(tmp_path):
    """mead-ml/mead-baseline#20 (written blind, batch blind-cb): Seq2SeqAttnModel's Luong attention took its softmax over
    every encoder output of a padded batch; the source is handed time-major (`src` T x B, as nn.LSTM takes it), its pad
    id its embedding's padding_idx. The first cell is a loop's over the keys past each row's length."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "mead_baseline_seq2seq_luong_attention_attends_source_padding", "encoder-padding-ignored")[0]
    lengths = [9, 4]
    assert tuple(hit["cell"]) == first((2, 1, 9), lambda b, q, k: k >= lengths[b])
    assert "time-major" in hit["source"]


def test_a_gru_seq2seq_with_a_time_major_source_and_its_mask_built_unused(tmp_path):
    """Written another way (bentrevett's pytorch-seq2seq, tutorial 4's model): `src` [src len, batch], the model's own
    `src_pad_idx`, a Luong "general" score by bmm, F.softmax(dim=1), the mask built and never applied; three rows of
    lengths 7, 5, 3. The fix (masked_fill(mask == 0, -1e10)) is quiet."""
    folder = Path(__file__).parent / "data" / "timemajor"
    status, found, report = traced(tmp_path, "luong_gru_time_major_source_mask_dropped", False, folder)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "encoder-padding-ignored")
    lengths = [7, 5, 3]
    assert hit["severity"] == "wrong" and tuple(hit["cell"]) == first((3, 1, 7), lambda b, q, k: k >= lengths[b])
    status, found, report = traced(tmp_path, "luong_gru_time_major_source_mask_dropped", True, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_dia_decoder_cross_attention_without_the_text_padding(tmp_path):
    """nari-labs/dia#230 (2811af1; written blind, batch blind-dl, caught before any rule was changed for it): each
    KV-cached decode step's CrossAttention over a text prompt padded to text_length is called with no attn_mask; the
    encoder's own mask marks the pad slots. The CFG pairs (rows 0-1: 5 tokens, rows 2-3: 11) read by a double loop."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "dia_decoder_cross_attention_text_padding_unmasked", "encoder-padding-ignored")[0]
    lengths = (5, 5, 11, 11)
    assert tuple(hit["cell"]) == first((4, 1, 16), lambda b, q, k: k >= lengths[b]), hit


def test_cached_cross_keys_of_a_left_padded_source_without_their_mask(tmp_path):
    """Written another way: a Whisper-style greedy decode over a left-padded batch of sources, `encoder_attn` projecting
    the encoder's states once into the cache dict and handing SDPA attn_mask=None each step; the first cell, by a
    double loop over the left padding (sources of 4 and 7 in 7 slots)."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "left_padded_source_cached_cross_kv_sdpa_no_mask", "encoder-padding-ignored", ENCODED)[0]
    pads = (7 - 4, 0)
    assert tuple(hit["cell"]) == first((2, 1, 7), lambda b, q, k: k < pads[b]), hit


def test_dia_cfg_cross_attention_over_a_cache_object_without_the_text_padding(tmp_path):
    """nari-labs/dia#230 (commit e4f886a, merged as 2811af1; written blind, batch blind-ed): DecoderLayer hands its
    CrossAttention the keys of a `cross_attn_cache` object (a KVCache, read as the memory: trace/crossing.py) and no
    attn_mask. Each prompt is paired with an unconditional row of padding only (rows 0, 2), so the encoder's segment
    mask (real with real, padding with padding) says which run is the padding in no row alone; the conditional rows
    (6 and 11 real tokens of 16) see both runs. The first such cell, by a double loop; the fix, whose uncond rows see
    no key and whose `padding_mask` (True = real) keeps the real text, is quiet (no padding-only-attended: the keys
    that name calls real are those it zeroed in K, checks/heldzero.py)."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "dia_decoder_cross_attention_ignores_text_padding_mask", "encoder-padding-ignored")[0]
    real = (0, 6, 0, 11)  # (an unconditional row: all padding, one run)
    assert tuple(hit["cell"]) == first((4, 1, 16), lambda b, q, k: 0 < real[b] <= k), hit
    assert "cross_attn_cache.k handed to DecoderLayer.forward()" in hit["message"], hit["message"]


def test_cfg_text_cross_kv_dict_left_padded_without_the_mask(tmp_path):
    """Written another way (MusicGen / Parler-TTS style): null prompts of one BOS token paired with each prompt, all
    left-padded; the text encoder hides the pads by a key padding mask; the decoder's cross-attention reads a dict
    `cross_kv` through one `attend` helper with no mask. The first cell, by a double loop over the left padding
    (rows of 1, 6, 1, 3 real tokens in 6 slots)."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "cfg_text_cross_kv_dict_left_padded_no_mask", "encoder-padding-ignored", ENCODED)[0]
    real = (1, 6, 1, 3)
    assert tuple(hit["cell"]) == first((4, 1, 6), lambda b, q, k: k < 6 - real[b]), hit
    assert "cross_kv['k'] handed to AudioDecoderLayer.forward()" in hit["message"], hit["message"]


def test_optimum_onnx_decoder_export_pops_the_encoder_attention_mask(tmp_path):
    """huggingface/optimum#1076 (b4b9b77; written blind, batch blind-fb, caught before any rule was changed for it):
    TextSeq2SeqOnnxConfig.inputs popped "attention_mask" for the decoder export, so the exported T5 decoder is run
    with no encoder_attention_mask and its cross-attention sees the padded encoder positions. The first cell flagged
    is a double loop's over the source ids at the pad id 0 (the tokenizer's right padding); the fix is quiet."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "optimum_onnx_seq2seq_decoder_export_drops_encoder_attention_mask",
                    "encoder-padding-ignored")[0]
    ids = [[5, 9, 13, 22, 7, 31, 40, 1], [8, 17, 3, 1, 0, 0, 0, 0]]
    assert tuple(hit["cell"]) == first((2, 1, 8), lambda b, q, k: ids[b][k] == 0), hit
    assert "the cross-attention mask drops the encoder's padding" in hit["message"], hit


MEMORY = Path(__file__).parent / "data" / "memory"


def test_a_decoder_step_export_wrapper_that_leaves_out_the_source_mask(tmp_path):
    """optimum#1076 written another way: a hand-written encoder-decoder (an nn.MultiheadAttention encoder with its
    key_padding_mask over a left-padded source, an eager masked_fill / softmax decoder, config a dataclass) exported
    through a positional decoder-step wrapper whose signature has no source mask; its src_attn calls mask nothing and
    the padding is read off the encoder's own mask. The first cell is a double loop's over the source's pad ids; the
    fix (the wrapper takes and hands on the mask) is quiet."""
    from checkbugs import check_bug

    found = check_bug(tmp_path, "mha_encoder_decoder_step_export_wrapper_drops_source_mask", "encoder-padding-ignored",
                      MEMORY)
    src = [[0, 0, 0, 7, 12, 5, 9, 3], [4, 8, 15, 16, 23, 11, 6, 2], [0, 0, 0, 0, 0, 21, 13, 2]]
    assert tuple(found[0]["cell"]) == first((3, 1, 8), lambda b, q, k: src[b][k] == 0), found
    assert "encoder's own self-attention (model.encoder.1.self_attn) marks as padding" in found[0]["message"], found


def test_a_decoder_step_export_wrapper_that_keeps_the_memory_padding_mask_is_quiet(tmp_path):
    """Correct: nn.Transformer over a left-padded source, the exported decoder step handed memory_key_padding_mask
    and passing it on to nn.TransformerDecoder: no finding that is wrong or suspicious."""
    status, found, report = traced(tmp_path, "transformer_decoder_step_export_keeps_memory_padding_mask", False, MEMORY)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_t5_cross_attention_bias_taken_from_block_0s_attention_weights(tmp_path):
    """transformers#4499 (written blind, batch blind-fs): with output_attentions, T5Stack took block 0's cross-attention
    *weights* as the bias of blocks 1+, dropping the encoder padding folded into it. The first cell: a double loop
    over the sources' lengths (7 and 4) at the training call's 4 decoder queries."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "t5_cross_attention_position_bias_takes_attention_weights", "encoder-padding-ignored")[0]
    lengths = [7, 4]
    assert tuple(hit["cell"]) == first((2, 4, 7), lambda b, q, k: k >= lengths[b]), hit


MEMORY = Path(__file__).parent / "data" / "memory"


def test_bert4keras_t5_encoder_output_not_zeroed_so_the_context_mask_keeps_padding(tmp_path):
    """bojone/bert4keras 184f10d (bert4keras#387; written blind, batch blind-fs): the decoder's context mask is Keras'
    Masking over the encoder output (a zero vector is padding), which the encoder never zeroed: every cross-attention
    (`decoder.cross_atts.N`: a cross-attention by its path) keeps the padded source, which the encoder's own
    self-attention masks. The first cell: a double loop over the sources' lengths (8 and 5) at the training call."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "bert4keras_t5_encoder_output_not_masked_cross_attention_sees_padding",
                    "encoder-padding-ignored")[0]
    lengths = [8, 5]
    assert tuple(hit["cell"]) == first((2, 5, 8), lambda b, q, k: k >= lengths[b]), hit
    assert "the encoder's own self-attention (encoder.atts.1)" in hit["message"], hit["message"]


def test_a_memory_mask_read_off_zero_vectors_of_an_encoder_output_never_zeroed(tmp_path):
    """Written another way: nn.TransformerEncoder / nn.TransformerDecoder (MHA), left-padded sources, the memory's key
    padding read as all-zero vectors of an encoder output ending in a LayerNorm. The first cell and the count: a double
    loop over the left padding (3, 0 and 1 pads) at the decoder's 3 queries. Its fix (masked_fill) is quiet; so is the
    same model handed `src == PAD` as its memory_key_padding_mask."""
    from checkbugs import check_bug

    name = "torch_transformer_memory_mask_from_zero_vectors_encoder_output_not_zeroed"
    hit = check_bug(tmp_path, name, "encoder-padding-ignored", MEMORY)[0]
    pads = [3, 0, 1]
    assert tuple(hit["cell"]) == first((3, 3, 7), lambda b, q, k: k < pads[b]), hit
    count = sum(k < pads[b] for b in range(3) for q in range(3) for k in range(7))
    assert f"({count} such cells)" in hit["message"], hit["message"]
    status, found, report = traced(tmp_path, "torch_transformer_memory_mask_from_source_ids_quiet", False, MEMORY)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_pixart_multi_prompt_masks_repeated_in_another_order_than_the_embeddings(tmp_path):
    """huggingface/diffusers#10103 (6a51427b6a; written blind, batch blind-fz): PixArtSigmaPipeline.encode_prompt repeated
    the T5 embeddings per image as p0,p0,p1,p1 and their masks as m0,m1,m0,m1. The prompts and the negative prompt are
    encoded in two T5 calls and the transformer handed [negative; positive]: each row's memory is mapped to the T5
    output row it copies (checks/memrows.py), so row 5 (prompt 0's states under prompt 1's mask) sees prompt 0's
    padding. The cell by a double loop over the tokenizer's lengths (its words and </s>); the fix, whose transformer
    rows are not the T5 calls' rows one to one either, is quiet (it was told encoder-padding-ignored before)."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "diffusers_pixart_sigma_multi_prompt_mask_repeated_in_wrong_order",
                    "encoder-padding-ignored")[0]
    prompts, negative, per = ["a cat", "a small blue bird sitting on a branch"], "", 2
    length = [len(p.split()) + 1 for p in prompts]
    memory = [len(negative.split()) + 1] * (2 * per) + [length[i // per] for i in range(2 * per)]  # (p0, p0, p1, p1)
    stated = [len(negative.split()) + 1] * (2 * per) + [length[i % 2] for i in range(2 * per)]  # (m0, m1, m0, m1)
    assert tuple(hit["cell"]) == first((8, 1, 10), lambda b, q, k: memory[b] <= k < stated[b]) == (5, 0, 3), hit
    assert "T5EncoderModel call whose output row 0 this row's encoder_hidden_states copies" in hit["message"], hit


def test_a_cfg_denoiser_whose_left_padded_text_masks_are_tiled_while_its_embeds_are_interleaved(tmp_path):
    """diffusers#10103 written another way: a hand-written text-to-audio denoiser (config a dict), prompts and negative
    prompts encoded in two calls of an SDPA text encoder over left-padded text, embeddings repeat_interleave'd and
    masks tiled, [conditional; unconditional], nn.MultiheadAttention's key_padding_mask. The first cell by a double loop
    over the left padding of each row's own prompt against the prompt its mask is; the fix is quiet."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "cfg_denoiser_text_mask_tiled_while_embeds_interleaved", "encoder-padding-ignored",
                    MEMORY)[0]
    prompts, negative, per, slots = [2, 10], [3, 2], 2, 12  # (real tokens of each text: its words and an end token)
    memory = [prompts[i // per] for i in range(4)] + [negative[i // per] for i in range(4)]
    stated = [prompts[i % 2] for i in range(4)] + [negative[i % 2] for i in range(4)]
    assert tuple(hit["cell"]) == first((8, 6, slots), lambda b, q, k: slots - stated[b] <= k < slots - memory[b]), hit


def test_cfg_caption_masks_expanded_like_their_embeds_and_cast_to_bf16_is_quiet(tmp_path):
    """Correct: negative and positive captions encoded apart, each expanded per image with its own mask, the states
    cast to bfloat16 (rows matched by their cast: trace/outrows.py), [negative; positive] handed to an eager DiT whose
    cross-attention adds a finfo.min bias. No finding that is wrong or suspicious."""
    status, found, report = traced(tmp_path, "cfg_caption_masks_expanded_like_embeds_bf16_quiet", False, MEMORY)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_cross_attention_masked_by_the_targets_padding_through_a_softmax_over_folded_rows(tmp_path):
    """jadore801120/attention-is-all-you-need-pytorch 94aae68 (written blind, batch blind-iv): the decoder's `enc_attn`
    masked by `get_attn_padding_mask(src_seq, tgt_seq)`, the target's pads laid on the source axis, source and target
    of one length; its ScaledDotProductAttention softmaxes `attn.view(-1, len_k)`, the scores' rows folded to 2-D
    (read as the scores they were: trace/scores.py as_unfolded), and a decoder's `enc_attn` is its cross-attention.
    Written another way: a translator whose memory reader is handed the memory as its key and softmaxes a 2-D view;
    the first cell against a loop over the source's and target's pads."""
    from checkbugs import check_bug

    blind = Path(__file__).parent / "data" / "blind"
    check_bug(tmp_path, "aiayn_pytorch_dec_enc_pad_mask_from_target_seq", "encoder-padding-ignored", blind)
    [hit] = check_bug(tmp_path, "seq2seq_flat_softmax_cross_mask_from_target_padding", "encoder-padding-ignored",
                      Path(__file__).parent / "data" / "memory")
    src = [[4, 9, 11, 7, 2], [6, 13, 2, 0, 0], [21, 22, 23, 24, 25]]
    tgt = [[5, 3, 8, 0, 0], [12, 14, 15, 16, 17], [18, 19, 20, 26, 0]]
    assert tuple(hit["cell"]) == first((3, 5, 5), lambda b, q, k: tgt[b][q] != 0 and src[b][k] == 0 and tgt[b][k] != 0)


def test_cfg_pytorch_bge_adapter_padded_embeddings_not_zeroed(tmp_path):
    """lucidrains/classifier-free-guidance-pytorch#7 (written blind, blind-lj, round 66; missed before: the
    cross-attention's 15 keys are a learned null key and BERT's 14, which no encoder's mask covered): the BGE adapter
    handed on BERT's hidden states unzeroed at the padding, so the mask the conditioner derives from the embeddings kept
    every key; the padding is BERT's own self-attention's, read over the call's keys 1-14 (the null key at 0 is the one
    key the dropped-condition call sees)."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "cfg_pytorch_bge_adapter_pad_embeddings_not_zeroed", "encoder-padding-ignored")[0]
    lengths = (5, 14)  # the prompts' tokens, [CLS] and [SEP] included
    assert tuple(hit["cell"]) == first((2, 64, 15), lambda b, q, k: k >= 1 + lengths[b]), hit
    assert "its keys the call's 1-14" in hit["message"]


def test_a_memory_with_learned_keys_appended_read_against_its_encoders_padding(tmp_path):
    """Written another way: nn.TransformerEncoder's padded memory with two register keys appended, its mask taken from
    the memory's (unzeroed) values; the padding read over the call's keys 0-5, the registers after them."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "memory_with_appended_register_keys_padding_dropped", "encoder-padding-ignored", ENCODED)[0]
    lengths = (6, 3)
    assert tuple(hit["cell"]) == first((2, 5, 8), lambda b, q, k: lengths[b] <= k < 6), hit
    assert "its keys the call's 0-5" in hit["message"]


def test_a_fusion_layers_cross_attention_over_an_unpadded_image_is_not_read_against_its_texts_padding(tmp_path):
    """ALBEF's VQA (written blind, quiet-r72a, a false alarm): each fusion layer's text self-attention hides the
    question's padding, then its cross-attention from the text to the image's patches (all real) masks nowhere. With
    fewer text tokens than patches, the patches were read as the text's keys and a few of the attention's own, and the
    text's padding as the memory's: the self-attention just before a cross-attention, of its own queries, states no
    memory's padding. The same program flagged before (tests/data/memory/, written another way) is quiet."""
    status, found, report = traced(tmp_path, "fusion_layer_text_padding_then_image_cross_attention", False, MEMORY)
    assert status == 0 and [f for f in found if f["code"] == "encoder-padding-ignored"] == [], report


def test_keras_io_translation_decoder_cross_attention_masked_by_the_targets_padding(tmp_path):
    """keras-team/keras-io#1997 (written blind, blind-qg, caught before any rule changed for it): the English-to-Spanish
    example's decoder hands its cross-attention the target's causal & padding mask, (T, T) laid over the source keys:
    batch row 0 (3 English tokens of 8) has decoder query 3 see encoder key 3, which the encoder's own self-attention
    masks. The fix hands key_mask=the encoder's padding: no encoder-padding-ignored, and its keras-style
    `encoder_outputs_padding_mask` (1 = real, the encoder's `mask`) is not read as turned round (test_checks_held)."""
    name = "keras_io_nmt_decoder_cross_attention_masked_by_target_padding"
    status, found, report = traced(tmp_path, name, False, BUGS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "encoder-padding-ignored" and f["severity"] == "wrong")
    assert tuple(hit["cell"]) == (0, 3, 3) and "encoder.attention" in hit["message"], hit
    status, found, report = traced(tmp_path, name, True, BUGS)
    assert not {"encoder-padding-ignored", "padding-only-attended"} & {f["code"] for f in found}, report


def test_alphafold2_seq2seq_padding_mask_off_by_default(tmp_path):
    """lucidrains/alphafold2 21b02a7 (written blind, blind-rg, caught before any rule changed for it): the torsion
    Seq2SeqTransformer's `use_padding_mask` defaulted to False, so its encoder, decoder and cross-attention took none
    of the padding masks train_simple built and handed it. The fix turns the encoder's and decoder's own masks on but
    never hands `memory_key_padding_mask` to the decoder: its cross-attention still attends the padded residues, and
    the finding stays, true of the fix as of the bug."""
    name = "alphafold2_seq2seq_torsion_transformer_padding_mask_off_by_default"
    for fixed in (False, True):
        status, found, report = traced(tmp_path, name, fixed)
        hits = [f for f in found if f["code"] == "encoder-padding-ignored"]
        assert status == 1 and hits and "memory_key_padding_mask given to Seq2SeqTransformer" in hits[0]["message"], report


def test_a_causal_lm_flagged_encoder_decoder_keeps_its_decoders_attention_mask(tmp_path):
    """Correct (written blind, quiet-r163a; encoder-padding-ignored before): Nougat sets is_encoder_decoder=True on its
    MBartForCausalLM to get cross-attention and hands it attention_mask = input_ids.ne(pad) each step. A *ForCausalLM's
    attention_mask is its decoder's (the encoder's is encoder_attention_mask), and the image memory has no padding."""
    status, found, report = traced(tmp_path, "quiet_nougat_mbart_decoder_batched_greedy_kv_cache_pad_after_eos", False,
                                   Path(__file__).parent / "data" / "quiet_blind")
    assert status == 0 and not [f for f in found if f["code"] == "encoder-padding-ignored"], report
