"""checks/subsampled.py: a frame key padding that keeps frames the model's own strided convolutions computed from
the padding, the frames each row's real samples make counted here by running the convolutions themselves."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced

SUBSAMPLED = Path(__file__).parent / "data" / "subsampled"


def made(n: int, layers) -> int:
    """How many frames `n` samples make through `layers`, by running them on a tensor of n samples."""
    x = torch.zeros(1, 1, n)
    for layer in layers:
        x = layer(x)
    return x.shape[-1]


def conv1d(k: int, s: int) -> torch.nn.Conv1d:
    return torch.nn.Conv1d(1, 1, k, stride=s)


def test_fairseq_wav2vec2_frame_mask_reshaped_from_samples(tmp_path):
    """fairseq#3227: 300 real samples of 400; the feature extractor's convs (10/5, 3/2, 2/2) make 14 frames of
    them, the reshape-and-all mask keeps 15."""
    [hit] = check_bug(tmp_path, "fairseq_wav2vec2_padding_mask_frame_all_reshape", "padded-frames-attended")
    real = made(300, [conv1d(10, 5), conv1d(3, 2), conv1d(2, 2)])
    assert hit["cell"] == [0, 0, real] and f"make {real} frames of them" in hit["message"]


def test_fairseq_hubert_frame_mask_reshaped_from_samples(tmp_path):
    """facebookresearch/fairseq#3572 (written blind, blind-qd, caught before any rule changed for it): HuBERT's copy of
    #3227's reshape-and-all, `forward_padding_mask`; 260 real samples of 400 in batch row 1 make 12 frames through
    the convs (10/5, 3/2, 2/2), and the encoder's key_padding_mask keeps a 13th."""
    [hit] = check_bug(tmp_path, "fairseq_hubert_forward_padding_mask_frame_view_all", "padded-frames-attended")
    real = made(260, [conv1d(10, 5), conv1d(3, 2), conv1d(2, 2)])
    assert hit["cell"] == [1, 0, real] and f"make {real} frames of them" in hit["message"], hit


def test_qefficient_cohere_asr_encoder_run_without_its_frame_mask(tmp_path):
    """quic/efficient-transformers abe7288a1 (written blind, batch blind-aw): the QPC forward ran the Parakeet encoder
    with no padding mask over a batch whose short clip has 41 real samples of 96: its strided convs make 6 frames of
    them, and the encoder's self-attention keeps all 12 (the fix hands it positions < feature_lengths)."""
    hit = check_bug(tmp_path, "qefficient_cohere_asr_scalar_valid_frames_encoder_mask", "padded-frames-attended")
    assert hit[0]["cell"][0] == 1 and "make 6 frames of them" in hit[0]["message"], hit


def test_sew_frame_mask_reshaped_from_samples_held_by_the_script(tmp_path):
    """asappresearch/sew PR #2 (written blind, batch blind-dz): fairseq#3227's reshape-and-all in SEW's
    FeatMLPWav2Vec2Model, the sample padding_mask held only by the script (the model reassigns its own to the frames):
    260 real samples of 400 make 12 frames through the convs (10/5, 3/2, 2/2), the reshaped mask keeps 13."""
    [hit] = check_bug(tmp_path, "sew_feat_mlp_wav2vec2_padding_mask_frame_view_all", "padded-frames-attended")
    real = made(260, [conv1d(10, 5), conv1d(3, 2), conv1d(2, 2)])
    assert hit["cell"] == [1, 0, real] and f"make {real} frames of them" in hit["message"], hit


def test_lengths_floored_by_the_hop_stated_by_the_script(tmp_path):
    """Written another way: torchaudio-style `lengths // hop` reassigned inside the model, the sample lengths stated
    only by the script's `wav_lens`, nn.MultiheadAttention batch_first with a key_padding_mask, three rows."""
    name = "torchaudio_style_lengths_floored_by_hop_script_lengths"
    real = made(730, [conv1d(10, 5), conv1d(3, 2), conv1d(3, 2)])
    status, found, report = traced(tmp_path, name, False, SUBSAMPLED)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "padded-frames-attended"]
    assert hit["severity"] == "wrong" and hit["cell"] == [1, 0, real] and real < 730 // 20, report
    status, found, report = traced(tmp_path, name, True, SUBSAMPLED)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_wenet_conv2d_subsampling_mask_sliced_from_the_end(tmp_path):
    """wenet#1602: 13 real frames of 20; two Conv2d(3, stride 2) make 2, the [:-2:2] slices keep all 4."""
    [hit] = check_bug(tmp_path, "wenet_conv2d_subsampling4_mask_sliced_from_end", "padded-frames-attended")
    real = made(13, [conv1d(3, 2), conv1d(3, 2)])
    assert hit["cell"] == [1, 0, real] and f"keeps frames {real}-3 of that row" in hit["message"]


def test_espnet_conv2d_subsampling_mask_sliced_over_the_padded_batch(tmp_path):
    """espnet#6633 (written blind, batch blind-a): lengths 40 and 29; two Conv2d(3, stride 2) make 6 frames of row 1's
    29, the sliced mask keeps 8."""
    [hit] = check_bug(tmp_path, "espnet_conv2d_subsampling_mask_from_padded_width", "padded-frames-attended")
    real = made(29, [conv1d(3, 2), conv1d(3, 2)])
    assert real == 6 and hit["cell"][0] == 1 and hit["cell"][2] == real, hit


def test_lengths_rounded_up_through_sdpa(tmp_path):
    """Written another way: Conv1d(5, stride 2) twice, lengths ceil(n / 4), SDPA's keep mask, three rows."""
    real = made(30, [conv1d(5, 2), conv1d(5, 2)])
    status, found, report = traced(tmp_path, "conformer_lengths_rounded_up_through_sdpa", False, SUBSAMPLED)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "padded-frames-attended"]
    assert hit["severity"] == "wrong" and hit["cell"] == [1, 0, real], report
    status, found, report = traced(tmp_path, "conformer_lengths_rounded_up_through_sdpa", True, SUBSAMPLED)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_the_stack_read_is_the_one_that_makes_the_frames():
    """_stack takes the layers, in order, that map the samples to exactly the call's frames (a positional conv after
    them is left out); none where no prefix does."""
    from maskcli.checks.subsampled import _stack

    layer = lambda k, s, p=0: ((k, s, p, 1, False), (k, s, p, 1, False))  # noqa: E731
    convs = (layer(10, 5), layer(3, 2), layer(2, 2), layer(8, 1, 4))
    assert _stack(convs, 400, made(400, [conv1d(10, 5), conv1d(3, 2), conv1d(2, 2)])) == [c[0] for c in convs[:3]]
    assert _stack(convs, 400, 21) is None


def test_fairseq_s2t_lengths_mask_first_padded_frame_kept_batch_folded_with_heads(tmp_path):
    """fairseq 8ad9f316 (written blind, batch blind-ar): `arange(0..T-1) > lengths` keeps the first padded frame; 12
    real samples of 20 make 6 frames through the Conv1d(3, stride 2, padding 1), the mask keeps 7, over a softmax whose
    rows are the batch of 2 folded with its 2 heads (bsz * num_heads)."""
    [hit] = check_bug(tmp_path, "fairseq_s2t_encoder_padding_mask_off_by_one", "padded-frames-attended")
    real = made(12, [torch.nn.Conv1d(1, 1, 3, stride=2, padding=1)])
    assert real == 6 and hit["cell"][2] == real and "batch row 1" in hit["message"], hit


def test_head_major_fold_of_a_mask_one_frame_long(tmp_path):
    """Written another way: two Conv1d(5, stride 2, padding 2), lengths counted by the same formula and masked with
    `<=`, the batch of 3 folded head-major (`repeat(heads, 1)`) into baddbmm + softmax; its fix (`<`) is quiet."""
    name = "s2t_head_major_fold_lengths_mask_one_frame_long"
    real = made(21, [torch.nn.Conv1d(1, 1, 5, stride=2, padding=2)] * 2)
    status, found, report = traced(tmp_path, name, False, SUBSAMPLED)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "padded-frames-attended"]
    assert hit["severity"] == "wrong" and hit["cell"] == [1, 0, real] and "batch row 1" in hit["message"], report
    status, found, report = traced(tmp_path, name, True, SUBSAMPLED)
    assert status == 0 and not [f for f in found if f["severity"] == "wrong"], report


def test_moonshine_strided_frame_mask_keeps_frames_made_partly_of_the_padding(tmp_path):
    """huggingface/transformers#35922's fix (written blind, batch blind-bq): `attention_mask[..., ::384][..., :mask_len]`
    keeps each frame whose stride's first sample is real: row 1's 9600 real samples make 23 frames through the convs,
    the mask keeps 25. Frames 23-24 are computed partly from the last real samples and partly from the padding (the
    input samples each reads found by autograd through the model's own conv stack), and the message says so."""
    blind = Path(__file__).parent / "data" / "blind"
    status, found, report = traced(tmp_path, "moonshine_batched_audio_padding_not_masked", True, blind)
    [hit] = {f["message"]: f for f in found if f["code"] == "padded-frames-attended"}.values()
    convs = [torch.nn.Conv1d(1, 1, 127, stride=64), torch.nn.Conv1d(1, 1, 7, stride=3), torch.nn.Conv1d(1, 1, 3, stride=2)]
    assert made(9600, convs) == 23 and "make 23 frames of them" in hit["message"]
    x = torch.zeros(1, 1, 28800, requires_grad=True)
    y = x
    for conv in convs:
        y = conv(y)
    reads = []
    for frame in (23, 24):
        (grad,) = torch.autograd.grad(y[0, 0, frame], x, retain_graph=True)
        reads.append(torch.nonzero(grad[0, 0] != 0).flatten())
    first, last = int(reads[0].min()), int(reads[0].max())
    assert all(int(r.min()) < 9600 <= int(r.max()) for r in reads)  # (each partly real, partly padding)
    assert "keeps frames 23-24 of that row" in hit["message"]
    assert "partly from the row's last real samples and partly from the padding" in hit["message"]
    assert f"frame 23 is computed from samples {first}-{last}, the row's real ones end at 9599" in hit["message"]


def test_espnet_conv2d_wo_posenc_mask_sliced_over_the_padded_batch(tmp_path):
    """espnet#6670 (written blind, batch blind-fx, caught before any change): Conv2dSubsamplingWOPosEnc, the contextual
    block encoder's front end, sliced the mask over the padded width; lengths 363 and 288, two Conv2d(3, stride 2) make
    71 frames of row 1's 288, the sliced mask keeps 72."""
    [hit] = check_bug(tmp_path, "espnet_contextual_block_conv2d_wo_posenc_mask_sliced_from_padded_width", "padded-frames-attended")
    real = made(288, [conv1d(3, 2), conv1d(3, 2)])
    assert real == 71 and hit["cell"][0] == 1 and hit["cell"][2] == real, hit


def test_sglang_omni_minicpmo_chunk_mask_anded_with_mel_lengths(tmp_path):
    """sgl-project/sglang-omni#1879 (written blind, batch blind-gb): MiniCPM-o's audio encoder ands its chunked-causal
    mask with `arange(T) < lens`, lens still counted in mel frames before the stride-2 conv2: the 24-frame clip keeps
    every one of the 20 frames, where the convolutions (k3/s1/p1, k3/s2/p1) make 12 of its 24 mel frames. A chunked
    mask, not a key padding: the keys the row's real frames see are read. The fix (lengths after the conv) is quiet."""
    [hit] = check_bug(tmp_path, "sglang_omni_minicpmo_audio_key_mask_mel_lengths_after_conv", "padded-frames-attended")
    x = torch.zeros(1, 1, 24)
    real = torch.nn.Conv1d(1, 1, 3, stride=2, padding=1)(torch.nn.Conv1d(1, 1, 3, padding=1)(x)).shape[-1]
    assert hit["cell"] == [1, 0, real] and f"make {real} frames of them" in hit["message"], hit


def test_a_streaming_chunk_mask_with_lengths_never_subsampled(tmp_path):
    """Written another way: WeNet's Conv2dSubsampling4 (two 3x3 stride-2 convolutions, no padding) and its
    subsequent_chunk_mask (chunk 4) and'd with a key padding from `xs_lens` as handed in; a hand-written masked_fill
    softmax, three utterances. The first cell is a double loop's: the keys a real frame of row 1 sees (its chunk and
    every earlier one, within the unsubsampled length) at or past the frames its 41 inputs make. --fixed is quiet."""
    name = "streaming_chunk_mask_lengths_not_subsampled"
    [hit] = check_bug(tmp_path, name, "padded-frames-attended", SUBSAMPLED)
    real, frames, chunk, given = made(41, [conv1d(3, 2), conv1d(3, 2)]), made(64, [conv1d(3, 2), conv1d(3, 2)]), 4, 41
    bad = sorted({k for q in range(real) for k in range(frames) if k < min((q // chunk + 1) * chunk, frames)
                  and k < given and k >= real})
    assert bad and hit["cell"] == [1, 0, bad[0]] and f"keeps frames {bad[0]}-{bad[-1]} of that row" in hit["message"], hit


def test_s3tokenizer_25hz_code_lengths_halved_once_for_two_strided_convolutions(tmp_path):
    """xingchensong/S3Tokenizer f583c97 (written blind, blind-vi, caught before any rule changed for it): the 25 Hz
    encoder's two stride-2 convolutions make (n + 1) // 2 frames twice, but it returned lengths halved once, so the
    model over the codes keeps codes made from padding. The reference: the convolutions' own arithmetic (k3/s2/p1 twice)
    over the 26-sample row of 40 against the lengths returned. Its fix is told made-frames-hidden, true of the program
    as written at both commits: the encoder's own mask, subsampled by striding the sample mask twice, keeps 6 frames
    where the convolutions make 7."""
    def conv(n):
        return (n + 2 * 1 - 3) // 2 + 1

    real, width = 26, 40
    made, returned, frames = conv(conv(real)), (real + 1) // 2, conv(conv(width))
    status, found, report = traced(tmp_path, "s3tokenizer_v1_25hz_code_len_not_halved_twice", False)
    said = [f for f in found if f["code"] == "padded-frames-attended" and f["severity"] == "wrong"]
    assert status == 1 and said, report
    assert f"make {made} frames of them, yet this attention over the {frames} frames keeps frames " \
        f"{made}-{min(returned, frames) - 1} of that row" in " ".join(said[0]["message"].split()), report
    status, found, report = traced(tmp_path, "s3tokenizer_v1_25hz_code_len_not_halved_twice", True)
    assert {f["code"] for f in found if f["severity"] == "wrong"} == {"made-frames-hidden"}, report
    strided = len(range(1, width, 2))  # (the encoder's mask: every other sample from 1, twice)
    kept = len([i for i in range(1, strided, 2) if 2 * i + 1 < real])
    assert kept == made - 1 and f"hides frame {kept} of that row" in " ".join(
        [f for f in found if f["code"] == "made-frames-hidden"][0]["message"].split()), report
