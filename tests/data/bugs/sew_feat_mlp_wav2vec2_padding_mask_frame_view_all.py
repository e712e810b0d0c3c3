# asappresearch/sew PR #2 (sew_asapp/models/feat_mlp_wav2vec2.py, FeatMLPWav2Vec2Model.forward).
# Bug: the sample-level padding_mask is reduced to frames by view(B, T, -1).all(-1) instead of from the conv output
# lengths, so frames computed over padded samples stay unmasked and the encoder attends to them.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D = 32
CONV_LAYERS = [(16, 10, 5), (16, 3, 2), (16, 2, 2)]  # (dim, kernel, stride), a small conv_feature_layers


class ConvFeatureExtractionModel(nn.Module):  # fairseq, mode="layer_norm"
    def __init__(self, conv_layers):
        super().__init__()
        blocks, in_d = [], 1
        for dim, k, stride in conv_layers:
            blocks.append(nn.Sequential(
                nn.Conv1d(in_d, dim, k, stride=stride, bias=False),
                nn.Sequential(TransposeLast(), nn.LayerNorm(dim), TransposeLast()),
                nn.GELU(),
            ))
            in_d = dim
        self.conv_layers = nn.ModuleList(blocks)

    def forward(self, x):
        x = x.unsqueeze(1)
        for conv in self.conv_layers:
            x = conv(x)
        return x


class TransposeLast(nn.Module):
    def forward(self, x):
        return x.transpose(-2, -1)


class TransformerSentenceEncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(D, 4)
        self.self_attn_layer_norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 64)
        self.fc2 = nn.Linear(64, D)
        self.final_layer_norm = nn.LayerNorm(D)

    def forward(self, x, self_attn_padding_mask=None):  # T x B x C, layer_norm_first=False
        residual = x
        x, attn = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask, need_weights=False)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        x = self.final_layer_norm(residual + x)
        return x, attn


class TransformerEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos_conv = nn.Sequential(nn.Conv1d(D, D, kernel_size=4, padding=2, groups=4), nn.GELU())
        self.layer_norm = nn.LayerNorm(D)
        self.layers = nn.ModuleList([TransformerSentenceEncoderLayer() for _ in range(2)])

    def forward(self, x, padding_mask=None):
        if padding_mask is not None:
            x = x.clone()
            x[padding_mask] = 0
        x_conv = self.pos_conv(x.transpose(1, 2))[..., :-1]  # SamePad
        x = x + x_conv.transpose(1, 2)
        x = self.layer_norm(x)
        x = x.transpose(0, 1)
        for layer in self.layers:
            x, _ = layer(x, self_attn_padding_mask=padding_mask)
        return x.transpose(0, 1)


class FeatMLPWav2Vec2Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature_extractor = ConvFeatureExtractionModel(CONV_LAYERS)
        self.layer_norm = nn.LayerNorm(16)
        self.post_extract_proj = nn.Linear(16, D)
        self.encoder = TransformerEncoder()

    def _get_feat_extract_output_lengths(self, input_lengths):
        def _conv_out_length(input_length, kernel_size, stride):
            return torch.floor((input_length - kernel_size) / stride + 1)

        for _, k, s in CONV_LAYERS:
            input_lengths = _conv_out_length(input_lengths, k, s)
        return input_lengths.to(torch.long)

    def forward(self, source, padding_mask=None, features_only=True):
        features = self.feature_extractor(source)
        features = features.transpose(1, 2)
        features = self.layer_norm(features)

        if padding_mask is not None:
            if FIXED:
                input_lengths = (1 - padding_mask.long()).sum(-1)
                # apply conv formula to get real output_lengths
                output_lengths = self._get_feat_extract_output_lengths(input_lengths)
                padding_mask = torch.zeros(features.shape[:2], dtype=features.dtype, device=features.device)
                # these two operations makes sure that all values
                # before the output lengths indices are attended to
                padding_mask[(torch.arange(padding_mask.shape[0], device=padding_mask.device), output_lengths - 1)] = 1
                padding_mask = (1 - padding_mask.flip([-1]).cumsum(-1).flip([-1])).bool()
            else:
                extra = padding_mask.size(1) % features.size(1)
                if extra > 0:
                    padding_mask = padding_mask[:, :-extra]
                padding_mask = padding_mask.view(padding_mask.size(0), features.size(1), -1)
                padding_mask = padding_mask.all(-1)

        if self.post_extract_proj is not None:
            features = self.post_extract_proj(features)
        x = self.encoder(features, padding_mask=padding_mask)
        return {"x": x, "padding_mask": padding_mask}


model = FeatMLPWav2Vec2Model().eval()
lens = [400, 260]
wav = [torch.randn(n) for n in lens]
source = torch.zeros(2, max(lens))
padding_mask = torch.zeros(2, max(lens), dtype=torch.bool)
for i, w in enumerate(wav):
    source[i, : len(w)] = w
    padding_mask[i, len(w):] = True

with torch.no_grad():
    batched = model(source, padding_mask)
    alone = model(wav[1][None], torch.zeros(1, lens[1], dtype=torch.bool))
n = alone["x"].shape[1]
print("valid frames short row: alone", n, "batched mask", int((~batched["padding_mask"][1]).sum()))
print("max |batched - alone| over the short row's frames:", float((batched["x"][1, :n] - alone["x"][0]).abs().max()))
