"""fairseq TransformerEncoderLayer drops attn_mask: VGGTransformerEncoder's limited-context mask never applied.

Citation: facebookresearch/fairseq issue #1339, and #1682 ("BART attn_mask unused"; maintainer: "It's a bug ...
We had a fix but it didn't get merged... I'll merge one now"), fixed by commit 42935dcc ("Fix attn_mask bug in
TransformerEncoderLayer (only affects speech_recognition example)"). Read: the fix diff and, at its parent,
fairseq/modules/transformer_layer.py, examples/speech_recognition/models/vggtransformer.py and
examples/speech_recognition/data/data_utils.py.

Bug: `TransformerEncoderLayer.forward(x, encoder_padding_mask, attn_mask=None)` converts `attn_mask` to an
additive -1e8 mask and then calls `self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask)`
without it. The speech recognition VGGTransformerEncoder, built with `transformer_context=(left, right)`, builds
that mask in `lengths_to_attn_mask` so each frame attends only to [t-left, t+right] (scaled by the VGG
subsampling); every frame attends to the whole utterance instead.

Fix: pass `attn_mask=attn_mask` to self_attn.

This program condenses VGGTransformerEncoder (one VGG block = conv + 2x max-pool over time and feature, one
transformer layer, transformer_context=(4, 2) frames -> (2, 1) after subsampling 2) and encodes two utterances of
20 and 14 feature frames. fairseq's MultiheadAttention is replaced by nn.MultiheadAttention, which takes the same
(T, B, C) inputs, key_padding_mask and additive attn_mask.
"""
import math
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
# nn.MultiheadAttention warns on a float attn_mask beside a bool key_padding_mask (fairseq's own MHA did not)
warnings.filterwarnings("ignore", message="Support for mismatched")


def lengths_to_encoder_padding_mask(lengths, batch_first=False):
    max_lengths = torch.max(lengths).item()
    bsz = lengths.size(0)
    encoder_padding_mask = torch.arange(max_lengths).to(lengths.device).view(1, max_lengths).expand(
        bsz, -1) >= lengths.view(bsz, 1).expand(-1, max_lengths)
    if not batch_first:
        return encoder_padding_mask.t(), max_lengths
    else:
        return encoder_padding_mask, max_lengths


class TransformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim, heads, ffn_dim, dropout=0.1, normalize_before=True):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(embed_dim, heads, dropout=dropout)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.dropout = dropout
        self.normalize_before = normalize_before
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, encoder_padding_mask, attn_mask=None):
        residual = x
        x = self.maybe_layer_norm(self.self_attn_layer_norm, x, before=True)
        if attn_mask is not None:
            attn_mask = attn_mask.masked_fill(attn_mask.bool(), -1e8)
        # anything in original attn_mask = 1, becomes -1e8
        # anything in original attn_mask = 0, becomes 0
        if FIXED:
            x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask,
                                  attn_mask=attn_mask)
        else:
            x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        x = self.maybe_layer_norm(self.self_attn_layer_norm, x, after=True)

        residual = x
        x = self.maybe_layer_norm(self.final_layer_norm, x, before=True)
        x = self.fc2(F.relu(self.fc1(x)))
        x = residual + x
        x = self.maybe_layer_norm(self.final_layer_norm, x, after=True)
        return x

    def maybe_layer_norm(self, layer_norm, x, before=False, after=False):
        assert before ^ after
        if after ^ self.normalize_before:
            return layer_norm(x)
        else:
            return x


class VGGBlock(nn.Module):
    """Condensed: one 3x3 conv, ReLU, 2x2 max-pool (time and feature)."""

    def __init__(self, in_channels, out_channels, input_dim):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.pool = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.output_dim = math.ceil(input_dim / 2)

    def forward(self, x):
        return self.pool(F.relu(self.conv(x)))


class VGGTransformerEncoder(nn.Module):
    def __init__(self, input_feat_per_channel, out_channels=4, embed_dim=16, in_channels=1,
                 transformer_context=None):
        super().__init__()
        self.in_channels = in_channels
        self.input_dim = input_feat_per_channel
        self.conv_layers = nn.ModuleList([VGGBlock(in_channels, out_channels, input_feat_per_channel)])
        transformer_input_dim = out_channels * self.conv_layers[-1].output_dim
        self.transformer_context = self.parse_transformer_context(transformer_context)
        self.transformer_sampling = (1,)
        self.transformer_layers = nn.ModuleList([nn.Linear(transformer_input_dim, embed_dim),
                                                 TransformerEncoderLayer(embed_dim, 2, 32)])

    def parse_transformer_context(self, transformer_context):
        if transformer_context is None:
            return None
        left_context = transformer_context[0]
        if left_context < 0:
            left_context = None
        right_context = transformer_context[1]
        if right_context < 0:
            right_context = None
        if left_context is None and right_context is None:
            return None
        return (left_context, right_context)

    def lengths_to_attn_mask(self, input_lengths, subsampling_factor=1):
        if self.transformer_context is None:
            return None
        maxT = torch.max(input_lengths).item()
        attn_mask = torch.zeros(maxT, maxT)
        left_context = self.transformer_context[0]
        right_context = self.transformer_context[1]
        if left_context is not None:
            left_context = math.ceil(self.transformer_context[0] / subsampling_factor)
        if right_context is not None:
            right_context = math.ceil(self.transformer_context[1] / subsampling_factor)
        for t in range(maxT):
            if left_context is not None:
                st = 0
                en = max(st, t - left_context)
                attn_mask[t, st:en] = 1
            if right_context is not None:
                st = t + right_context + 1
                st = min(st, maxT - 1)
                attn_mask[t, st:] = 1
        return attn_mask.to(input_lengths.device)

    def forward(self, src_tokens, src_lengths, **kwargs):
        bsz, max_seq_len, _ = src_tokens.size()
        x = src_tokens.view(bsz, max_seq_len, self.in_channels, self.input_dim)
        x = x.transpose(1, 2).contiguous()
        for layer_idx in range(len(self.conv_layers)):
            x = self.conv_layers[layer_idx](x)
        bsz, _, output_seq_len, _ = x.size()
        x = x.transpose(1, 2).transpose(0, 1)
        x = x.contiguous().view(output_seq_len, bsz, -1)

        subsampling_factor = int(max_seq_len * 1.0 / output_seq_len + 0.5)
        input_lengths = (src_lengths.float() / subsampling_factor).ceil().long()
        encoder_padding_mask, _ = lengths_to_encoder_padding_mask(input_lengths, batch_first=True)
        if not encoder_padding_mask.any():
            encoder_padding_mask = None
        attn_mask = self.lengths_to_attn_mask(input_lengths, subsampling_factor)

        for layer in self.transformer_layers:
            if isinstance(layer, TransformerEncoderLayer):
                x = layer(x, encoder_padding_mask, attn_mask)
            else:
                x = layer(x)
        return {"encoder_out": x,
                "encoder_padding_mask": encoder_padding_mask.t() if encoder_padding_mask is not None else None}


if __name__ == "__main__":
    torch.manual_seed(0)
    encoder = VGGTransformerEncoder(input_feat_per_channel=8, transformer_context=(4, 2)).eval()
    src_lengths = torch.tensor([20, 14])
    src_tokens = torch.randn(2, 20, 8)
    src_tokens[1, 14:] = 0.0
    with torch.no_grad():
        out = encoder(src_tokens, src_lengths)["encoder_out"]
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out[0, 0].sum().item():.4f} {out[0, 0, 0].item():.4f}")
