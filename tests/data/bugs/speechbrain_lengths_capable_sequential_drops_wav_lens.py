"""SpeechBrain LengthsCapableSequential: a HF wav2vec2 lobe taking `wav_lens` never receives the lengths.

Citation: speechbrain/speechbrain#2986 ("Running inference per batch alters the generated transcript"), fixed by
PR #3068 ("Fix LengthsCapable containers dropping lengths for wav_lens-named layers", merged). Read: the issue
and PR descriptions, and the pre-fix sources speechbrain/utils/callchains.py (`lengths_arg_exists`),
speechbrain/nnet/containers.py (`LengthsCapableSequential`), speechbrain/integrations/huggingface/wav2vec2.py
(`forward(self, wav, wav_lens=None)` -> `make_padding_masks` -> `self.model(wav, attention_mask=...)`). The PR's
diff was not read; the fixed container below follows its description (`lengths_arg_name` returning the
parameter's actual name, `lengths` or `wav_lens`).

Bug: `LengthsCapableSequential.append` records `lengths_arg_exists(forward)`, which only matches a parameter
literally named `lengths`. The HF lobes name it `wav_lens`, so in an `encoder: LengthsCapableSequential` used
by `EncoderASR` the wav2vec2 lobe is called as `layer(x)`: `make_padding_masks(wav, wav_len=None)` returns None
and the transformer runs with `attention_mask=None`, so the frames of the shorter utterance attend to the
zero padding of the batch.

Fix: pass the lengths under the layer's own parameter name.

Stand-in: transformers' Wav2Vec2Model is replaced by a small torch model with the same call
(`model(wav, attention_mask=...)`, conv feature extractor, frame mask reduced by the conv lengths as HF's
`_get_feature_vector_attention_mask`, SDPA self-attention), because importing transformers does not fit the 3 s
budget. The rest is SpeechBrain's code, condensed.
"""
import inspect
import sys
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# speechbrain/utils/callchains.py
def lengths_arg_exists(func):
    spec = inspect.getfullargspec(func)
    return "lengths" in spec.args + spec.kwonlyargs


def lengths_arg_name(func):
    """Name of func's relative-lengths parameter (`lengths` or `wav_lens`), or None (PR #3068)."""
    spec = inspect.getfullargspec(func)
    for name in ("lengths", "wav_lens"):
        if name in spec.args + spec.kwonlyargs:
            return name
    return None


# speechbrain/dataio/dataio.py
def length_to_mask(length, max_len=None, dtype=None, device=None):
    assert len(length.shape) == 1
    if max_len is None:
        max_len = length.max().long().item()
    mask = torch.arange(max_len, device=length.device, dtype=length.dtype).expand(
        len(length), max_len) < length.unsqueeze(1)
    if dtype is None:
        dtype = length.dtype
    return torch.as_tensor(mask, dtype=dtype, device=device)


# speechbrain/integrations/huggingface/huggingface.py
def make_padding_masks(src, wav_len=None, pad_idx=0):
    src_key_padding_mask = None
    if wav_len is not None:
        abs_len = torch.round(wav_len * src.shape[1])
        src_key_padding_mask = length_to_mask(abs_len).bool()
    return src_key_padding_mask


class TinyWav2Vec2Model(nn.Module):
    """Stand-in for transformers.Wav2Vec2Model: conv features, reduced frame mask, one SDPA encoder layer."""

    def __init__(self, hidden=16, heads=2, kernels=(10, 3), strides=(5, 2)):
        super().__init__()
        self.kernels, self.strides, self.heads = kernels, strides, heads
        self.convs = nn.ModuleList([nn.Conv1d(1, hidden, kernels[0], strides[0]),
                                    nn.Conv1d(hidden, hidden, kernels[1], strides[1])])
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def _get_feat_extract_output_lengths(self, input_lengths):
        for kernel_size, stride in zip(self.kernels, self.strides):
            input_lengths = torch.div(input_lengths - kernel_size, stride, rounding_mode="floor") + 1
        return input_lengths

    def forward(self, input_values, attention_mask=None, output_hidden_states=False):
        x = input_values.unsqueeze(1)
        for conv in self.convs:
            x = F.gelu(conv(x))
        hidden_states = x.transpose(1, 2)  # (B, T, C)
        B, T, C = hidden_states.shape
        mask = None
        if attention_mask is not None:
            output_lengths = self._get_feat_extract_output_lengths(attention_mask.sum(-1))
            frame_mask = torch.arange(T)[None, :] < output_lengths[:, None]
            mask = frame_mask[:, None, None, :]
        q, k, v = self.qkv(hidden_states).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.transpose(1, 2).reshape(B, T, C)
        return self.norm(hidden_states + self.out(attn))


# speechbrain/integrations/huggingface/wav2vec2.py (condensed)
class Wav2Vec2(nn.Module):
    def __init__(self, freeze=True, output_norm=False):
        super().__init__()
        self.model = TinyWav2Vec2Model()
        self.freeze = freeze
        self.output_norm = output_norm
        self.normalize_wav = False

    def forward(self, wav, wav_lens=None):
        if self.freeze:
            with torch.no_grad():
                return self.extract_features(wav, wav_lens)
        return self.extract_features(wav, wav_lens)

    def extract_features(self, wav, wav_lens=None):
        padding_mask = make_padding_masks(wav, wav_len=wav_lens)
        if self.normalize_wav:
            wav = F.layer_norm(wav, wav.shape[1:])
        out = self.model(wav, attention_mask=padding_mask)
        if self.output_norm:
            out = F.layer_norm(out, out.shape[1:])
        return out


# speechbrain/nnet/containers.py (Sequential condensed to an OrderedDict of layers)
class LengthsCapableSequential(nn.ModuleDict):
    def __init__(self, *layers):
        super().__init__()
        self.takes_lengths = []
        for i, layer in enumerate(layers):
            self.append(f"layer_{i}", layer)

    def append(self, name, layer):
        self[name] = layer
        latest_forward_method = list(self.values())[-1].forward
        if FIXED:
            self.takes_lengths.append(lengths_arg_name(latest_forward_method))
        else:
            self.takes_lengths.append(lengths_arg_exists(latest_forward_method))

    def forward(self, x, lengths=None):
        for layer, give_lengths in zip(self.values(), self.takes_lengths):
            if FIXED and give_lengths:
                x = layer(x, **{give_lengths: lengths})
            elif give_lengths:
                x = layer(x, lengths=lengths)
            else:
                x = layer(x)
            if isinstance(x, tuple):
                x = x[0]
        return x


if __name__ == "__main__":
    torch.manual_seed(0)
    encoder = LengthsCapableSequential(Wav2Vec2(freeze=True), nn.Linear(16, 8))
    encoder.eval()
    # EncoderASR.encode_batch(wavs, wav_lens): 1600 and 960 samples, right zero-padded, relative lengths
    wavs = torch.randn(2, 1600)
    wavs[1, 960:] = 0.0
    wav_lens = torch.tensor([1.0, 0.6])
    with torch.no_grad():
        encoder_out = encoder(wavs, wav_lens)
    print("fixed" if FIXED else "buggy", tuple(encoder_out.shape), f"{encoder_out[1, 0].sum().item():.4f}")
