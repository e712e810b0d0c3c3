"""checks/convpad.py (and trace/convpad.py, which records what a convolution reads): padded frames with content that
a time-mixing convolution mixes into real ones, where the same model call's self-attention masks them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from checkbugs import check_bug, traced
from maskcli.trace.capture import Trace

CONVPAD = Path(__file__).parent / "data" / "convpad"


def test_wenet_conformer_conv_module_ignores_batch_padding_mask(tmp_path):
    """wenet-e2e/wenet#223 (commit 1a603a7): ConformerEncoderLayer called its ConvolutionModule without `mask_pad`;
    the first row with padding (lengths 16, 9, 5) names its last real frame and its first padded one."""
    [hit] = check_bug(tmp_path, "wenet_conformer_conv_module_ignores_batch_padding_mask", "padding-convolved")
    assert tuple(hit["cell"]) == (1, 8, 9)


def test_torchaudio_conformer_conv_module_ignores_key_padding_mask(tmp_path):
    """pytorch/audio#4205 (fix proposed in pytorch/audio#4206): `_ConvolutionModule` never got the key_padding_mask its
    ConformerLayer's MultiheadAttention masks (lengths 24, 15, 9)."""
    [hit] = check_bug(tmp_path, "torchaudio_conformer_conv_module_ignores_key_padding_mask", "padding-convolved")
    assert tuple(hit["cell"]) == (1, 14, 15)


def test_nemo_conv_module_not_given_pad_mask(tmp_path):
    """Written another way: SDPA's bool keep mask, padding="same" with dilation 2, pad_mask not handed on; the padded
    frames a real frame reads are a loop's over the kernel's taps."""
    [hit] = check_bug(tmp_path, "nemo_conv_module_not_given_pad_mask", "padding-convolved", folder=CONVPAD)
    n, kernel, dilation, left = 7, 5, 2, 4  # row 0 of lengths 7, 12, 10, 12
    taps = [n - 1 - left + j * dilation for j in range(kernel)]
    assert tuple(hit["cell"]) == (0, n - 1, n) and max(taps) == 10
    assert "padded frames\n   7..10" in hit["message"] or "padded frames 7..10" in " ".join(hit["message"].split())


def _recorded(run) -> tuple:
    """What trace/convpad.py recorded of the convolutions `run` made inside one outermost module call."""
    class Model(torch.nn.Module):
        def forward(self, x):
            q = x.transpose(1, 2)[:, None]
            F.scaled_dot_product_attention(q, q, q)
            return run(x)

    with Trace() as t:
        Model()(torch.zeros(2, 3, 6))
    return t.tops[0].convs


def test_constant_tails_against_a_loop():
    """Each row's constant tail (the first frame from which every frame equals the last) against a plain loop; a causal
    convolution (no later frame read) has none, and a strided one is not recorded."""
    x = torch.randn(2, 3, 6)
    x[0, :, 3:] = 1.5  # row 0: frames 3..5 one constant frame
    x[1, :, 5] = x[1, :, 2]  # row 1: frame 2 equals the last one, frames 3 and 4 do not
    weight = torch.randn(3, 1, 3)
    [conv] = _recorded(lambda _: F.conv1d(x, weight, padding=1, groups=3))

    def tail(row):
        t = x.shape[-1] - 1
        while t > 0 and torch.equal(x[row, :, t - 1], x[row, :, -1]):
            t -= 1
        return t

    assert conv["tails"] == (tail(0), tail(1)) == (3, 5)
    assert (conv["reach"], conv["kernel"], conv["padding"]) == (1, 3, 1)
    [causal] = _recorded(lambda _: F.conv1d(x, weight, padding=2, groups=3)[..., :-2])  # causal: trimmed after
    assert (causal["reach"], causal["tails"]) == (0, ())  # (no later frame read: its zero frames alone, convleft.py)
    [padded] = _recorded(lambda _: F.conv1d(F.pad(x, (2, 0)), weight, groups=3))  # causal: padded before, so it runs
    assert padded["frames"] == 8  # over 8 frames, not the attention's 6 (the rule reads convolutions of its T only)
    assert _recorded(lambda _: F.conv1d(x, weight, stride=2, padding=1, groups=3)) == ()  # subsampling


def test_zeroed_padding_is_quiet(tmp_path):
    """The fixes zero the padded frames before the depthwise conv (torchaudio's) or before a pointwise conv whose bias
    makes them one constant frame again (wenet's): neither says padding-convolved."""
    for name, folder in (("wenet_conformer_conv_module_ignores_batch_padding_mask", None),
                         ("nemo_conv_module_not_given_pad_mask", CONVPAD)):
        status, found, report = traced(tmp_path, name, True, *((folder,) if folder else ()))
        assert status == 0 and not [f for f in found if f["code"] == "padding-convolved"], report


def _first_padded(lengths: list[int], before: int) -> tuple[int, int, int]:
    """The reference: (row, last real key, first padded key) of the first row shorter than the longest, its frames the
    attention's keys after `before` tokens put ahead of them."""
    b = next(i for i, n in enumerate(lengths) if n < max(lengths))
    return b, before + lengths[b] - 1, before + lengths[b]


def test_voicebox_conv_position_embed_ignores_padding_mask(tmp_path):
    """lucidrains/voicebox-pytorch d079b26 (written blind, batch blind-es): ConvPositionEmbed's depthwise conv ran over
    the ODE noise of padded frames before the transformer, which prepends 4 register tokens and pads the
    `self_attn_mask` with True for them: the conv's 24 frames are the attention's last 24 keys (lengths 24, 13, 18)."""
    [hit] = check_bug(tmp_path, "voicebox_pytorch_conv_position_embed_ignores_padding_mask", "padding-convolved")
    assert tuple(hit["cell"]) == _first_padded([24, 13, 18], 4)
    assert "(3, 24) mask" in " ".join(hit["message"].split())


def test_f5_tts_conv_position_embedding_unmasked_batch_padding(tmp_path):
    """SWivid/F5-TTS a051a68 (issues #1039, #1179; written blind, batch blind-es): DiT.get_input_embed never handed
    `audio_mask` to ConvPositionEmbedding, whose convs run over 3 rows that classifier-free guidance doubles to 6
    before the attention (durations 32, 20, 26)."""
    [hit] = check_bug(tmp_path, "f5_tts_dit_conv_position_embedding_unmasked_batch_padding", "padding-convolved")
    assert tuple(hit["cell"]) == _first_padded([32, 20, 26], 0)


def test_speaker_token_before_frames_mha_key_padding(tmp_path):
    """Written another way: one speaker token before the frames, nn.MultiheadAttention's key_padding_mask (True =
    padding) handed to the model, the padded frames holding sinusoidal positions (lengths 11, 16, 7)."""
    [hit] = check_bug(tmp_path, "speaker_token_conv_pos_embed_before_mha_key_padding", "padding-convolved",
                      folder=CONVPAD)
    assert tuple(hit["cell"]) == _first_padded([11, 16, 7], 1)


def test_cfg_doubled_batch_sdpa_float_mask(tmp_path):
    """Written another way: the conv runs per guidance branch over 4 rows, 8 attend under an additive float mask, the
    padding stated as a 0/1 integer `x_mask`; a dilated conv (lengths 9, 14, 12, 6)."""
    [hit] = check_bug(tmp_path, "cfg_doubled_batch_conv_embed_sdpa_float_mask", "padding-convolved", folder=CONVPAD)
    assert tuple(hit["cell"]) == _first_padded([9, 14, 12, 6], 0)


def test_a_convolution_before_the_first_attention_call_is_the_model_calls():
    """A convolution that runs before the model call's first attention call is recorded with that call, with the
    call's own 2-D masks (either polarity) as the prefix lengths they state; one that ran in another module call
    before it is not."""
    weight = torch.randn(3, 1, 3)

    class Model(torch.nn.Module):
        def forward(self, x, pad_mask):
            x = x + F.conv1d(x, weight, padding=1, groups=3)
            q = x.transpose(1, 2)[:, None]
            return F.scaled_dot_product_attention(q, q, q)

    class Other(torch.nn.Module):
        def forward(self, x):
            return F.conv1d(x, weight, padding=1, groups=3)

    pad_mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    with Trace() as t:
        Other()(torch.randn(2, 3, 5))
        Model()(torch.randn(2, 3, 6), pad_mask)
    [conv] = t.tops[0].convs
    assert conv["frames"] == 6
    real = (~pad_mask).sum(1).tolist()
    assert ((2, 6), tuple(real)) in conv["stated"] and real == [6, 4]


def test_espnet_conformer_conv_module_not_handed_the_mask(tmp_path):
    """espnet/espnet#6660 (written blind, batch blind-ou; caught before any rule changed for it): the conformer layer
    masked its self-attention only and called `conv_module(x)` without the mask, so the depthwise convolution (kernel
    15) reads the padded frames' biased content into the shorter utterance's last real frames; the fix zeroes them
    first. Lengths 40 and 27: row 1's last real frame 26 reaches frames 27..26 + 15 // 2."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "espnet_conformer_conv_module_reads_padded_frames", "padding-convolved")[0]
    last, half = 27 - 1, 15 // 2
    assert tuple(hit["cell"]) == (1, last, last + 1)
    assert f"real frame {last} is convolved with padded frames {last + 1}..{last + half}" in hit["message"]


def test_seamless_m4t_checkpointed_conformer_layers_drop_the_conv_mask(tmp_path):
    """huggingface/transformers#31945 (written blind, batch blind-zj; caught before any rule changed for it): with
    gradient checkpointing, SeamlessM4T's conformer encoder called each layer without conv_attention_mask, so the
    depthwise convolution (kernel 7) read the padded frames into the shorter utterance's last real frames (20, 13)."""
    hit = check_bug(tmp_path, "seamless_m4t_conformer_checkpointed_layers_drop_conv_attention_mask", "padding-convolved")[0]
    assert hit["cell"][0] == 1 and hit["cell"][1] == 12, hit
