# speechbrain/speechbrain#1597 (fixed by PR #1596): the HuggingFaceWav2Vec2 lobe ran the HF Wav2Vec2Model on a
# zero-padded batch without an attention_mask, so short utterances attended to the padded frames.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Wav2Vec2Config, Wav2Vec2Model

FIXED = "--fixed" in sys.argv


def length_to_mask(length, max_len=None, dtype=None, device=None):
    """speechbrain.dataio.dataio.length_to_mask"""
    if max_len is None:
        max_len = length.max().long().item()
    mask = torch.arange(max_len, device=length.device, dtype=length.dtype).expand(
        len(length), max_len) < length.unsqueeze(1)
    if dtype is None:
        dtype = length.dtype
    return torch.as_tensor(mask, dtype=dtype, device=device)


class HuggingFaceWav2Vec2(nn.Module):
    def __init__(self, config, output_norm=False, freeze=True, normalize_wav=False):
        super().__init__()
        self.model = Wav2Vec2Model(config)
        self.normalize_wav = normalize_wav
        self.output_norm = output_norm
        self.freeze = freeze
        if self.freeze:
            self.model.eval()

    def forward(self, wav, wav_lens=None):
        if self.freeze:
            with torch.no_grad():
                return self.extract_features(wav, wav_lens).detach()
        return self.extract_features(wav, wav_lens)

    def extract_features(self, wav, wav_lens=None):
        if self.normalize_wav:
            wav = F.layer_norm(wav, wav.shape[1:])
        if FIXED:
            padding_mask = self.make_masks(wav, wav_len=wav_lens)
            out = self.model(wav, attention_mask=padding_mask).last_hidden_state
        else:
            out = self.model(wav).last_hidden_state
        if self.output_norm:
            out = F.layer_norm(out, out.shape[1:])
        return out

    def make_masks(self, src, wav_len=None):
        attention_mask = None
        if wav_len is not None:
            abs_len = torch.round(wav_len * src.shape[1])
            attention_mask = length_to_mask(abs_len).long()
        return attention_mask


def main():
    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), conv_bias=True,
        feat_extract_norm="layer", do_stable_layer_norm=True,
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, apply_spec_augment=False,
    )
    config._attn_implementation = "sdpa"
    encoder = HuggingFaceWav2Vec2(config)

    short, long = torch.randn(400), torch.randn(1000)
    wavs = torch.zeros(2, 1000)
    wavs[0, :400] = short
    wavs[1] = long
    wav_lens = torch.tensor([0.4, 1.0])  # SpeechBrain relative lengths

    feats = encoder(wavs, wav_lens)
    alone = encoder(short[None], torch.tensor([1.0]))
    n = alone.shape[1]
    diff = (feats[0, :n] - alone[0]).abs().max().item()
    print(f"fixed={FIXED} short utterance, max |batched - alone| over its {n} frames: {diff:.3e}")


if __name__ == "__main__":
    main()
