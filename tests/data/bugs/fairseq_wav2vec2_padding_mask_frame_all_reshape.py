"""fairseq Wav2Vec2Model: frame padding mask downsampled by reshaping the sample mask (fairseq#3227).

Citation: facebookresearch/fairseq#3227 ("[Wav2Vec2] Possible bug with batched input") and the
fix proposed in facebookresearch/fairseq#3228 ("[Wav2Vec2] Fix padding mask for new architectures",
patrickvonplaten); the same fix (the "apply conv formula to get real output_lengths" block) is
what fairseq's wav2vec2.py / hubert.py carry today.

Bug: Wav2Vec2Model.forward turned the sample-level ``padding_mask`` (B, T_samples, True = pad)
into a frame-level mask by cutting off ``T_samples % T_frames`` samples, reshaping to
(B, T_frames, -1) and calling ``.all(-1)``: a frame is padding only if every sample of its
equal-width slice is padding. That slice is not the conv stack's receptive field, so a shorter
utterance keeps frames the convolutions computed (partly) from zero padding as real keys of the
transformer encoder's self-attention.

Fix: count each row's real samples, run them through the conv length formula
(``_get_feat_extract_output_lengths``) and mark every frame at or after that length as padding.

Reproduction: a tiny layer-norm-extractor Wav2Vec2 (config as a dataclass, as fairseq's
Wav2Vec2Config) on a batch of two waveforms of 400 and 300 samples. The conv stack gives 19
frames; the real length of the 300-sample row is 14 frames, while the reshape rule keeps 15,
so frame 14 of row 0 is attended as a key in every encoder layer before the fix.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Wav2Vec2Config:
    extractor_mode: str = "layer_norm"
    conv_feature_layers: str = "[(32, 10, 5)] + [(32, 3, 2)] + [(32, 2, 2)]"
    conv_bias: bool = False
    encoder_layers: int = 2
    encoder_embed_dim: int = 32
    encoder_ffn_embed_dim: int = 64
    encoder_attention_heads: int = 4
    conv_pos: int = 8
    conv_pos_groups: int = 4
    dropout: float = 0.0
    attention_dropout: float = 0.0


class Fp32LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).type_as(x)


class TransposeLast(nn.Module):
    def forward(self, x):
        return x.transpose(-2, -1)


class ConvFeatureExtractionModel(nn.Module):
    def __init__(self, conv_layers, mode="layer_norm", conv_bias=False):
        super().__init__()
        in_d = 1
        self.conv_layers = nn.ModuleList()
        for dim, k, stride in conv_layers:
            self.conv_layers.append(
                nn.Sequential(
                    nn.Conv1d(in_d, dim, k, stride=stride, bias=conv_bias),
                    nn.Sequential(TransposeLast(), Fp32LayerNorm(dim, elementwise_affine=True), TransposeLast()),
                    nn.GELU(),
                )
            )
            in_d = dim

    def forward(self, x):
        # BxT -> BxCxT
        x = x.unsqueeze(1)
        for conv in self.conv_layers:
            x = conv(x)
        return x


class TransformerSentenceEncoderLayer(nn.Module):
    def __init__(self, embedding_dim, ffn_embedding_dim, num_attention_heads, dropout, attention_dropout):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(embedding_dim, num_attention_heads, dropout=attention_dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.self_attn_layer_norm = nn.LayerNorm(embedding_dim)
        self.fc1 = nn.Linear(embedding_dim, ffn_embedding_dim)
        self.fc2 = nn.Linear(ffn_embedding_dim, embedding_dim)
        self.final_layer_norm = nn.LayerNorm(embedding_dim)

    def forward(self, x, self_attn_padding_mask=None):
        residual = x
        x, attn = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask, need_weights=False)
        x = self.dropout1(x)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        x = self.final_layer_norm(residual + x)
        return x, attn


class TransformerEncoder(nn.Module):
    def __init__(self, args: Wav2Vec2Config):
        super().__init__()
        self.embedding_dim = args.encoder_embed_dim
        self.pos_conv = nn.Sequential(
            nn.Conv1d(self.embedding_dim, self.embedding_dim, kernel_size=args.conv_pos,
                      padding=args.conv_pos // 2, groups=args.conv_pos_groups),
            nn.GELU(),
        )
        self.layers = nn.ModuleList(
            TransformerSentenceEncoderLayer(self.embedding_dim, args.encoder_ffn_embed_dim,
                                            args.encoder_attention_heads, args.dropout, args.attention_dropout)
            for _ in range(args.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(self.embedding_dim)

    def forward(self, x, padding_mask=None):
        if padding_mask is not None:
            x = x.masked_fill(padding_mask.unsqueeze(-1), 0)
        x_conv = self.pos_conv(x.transpose(1, 2))[:, :, : x.size(1)]
        x = self.layer_norm(x + x_conv.transpose(1, 2))
        # B x T x C -> T x B x C
        x = x.transpose(0, 1)
        for layer in self.layers:
            x, _ = layer(x, self_attn_padding_mask=padding_mask)
        return x.transpose(0, 1)


class Wav2Vec2Model(nn.Module):
    def __init__(self, cfg: Wav2Vec2Config):
        super().__init__()
        self.cfg = cfg
        feature_enc_layers = eval(cfg.conv_feature_layers)
        self.embed = feature_enc_layers[-1][0]
        self.feature_extractor = ConvFeatureExtractionModel(feature_enc_layers, cfg.extractor_mode, cfg.conv_bias)
        self.post_extract_proj = (
            nn.Linear(self.embed, cfg.encoder_embed_dim) if self.embed != cfg.encoder_embed_dim else None
        )
        self.layer_norm = nn.LayerNorm(self.embed)
        self.encoder = TransformerEncoder(cfg)

    def _get_feat_extract_output_lengths(self, input_lengths: torch.LongTensor):
        """Computes the output length of the convolutional layers."""

        def _conv_out_length(input_length, kernel_size, stride):
            return torch.floor((input_length - kernel_size) / stride + 1)

        conv_cfg_list = eval(self.cfg.conv_feature_layers)
        for i in range(len(conv_cfg_list)):
            input_lengths = _conv_out_length(input_lengths, conv_cfg_list[i][1], conv_cfg_list[i][2])
        return input_lengths.to(torch.long)

    def forward(self, source, padding_mask=None):
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


def main():
    torch.manual_seed(0)
    model = Wav2Vec2Model(Wav2Vec2Config()).eval()

    input_wav_0 = torch.randn(300)
    input_wav_1 = torch.randn(400)
    batch_input_wav = torch.zeros(2, 400)
    batch_input_wav[0, : input_wav_0.shape[-1]] = input_wav_0
    batch_input_wav[1, : input_wav_1.shape[-1]] = input_wav_1
    padding_mask = torch.zeros(2, 400, dtype=torch.bool)
    padding_mask[0, input_wav_0.shape[-1]:] = True

    with torch.no_grad():
        out = model(batch_input_wav, padding_mask=padding_mask)
    print("frames", out["x"].shape[1], "real frames per row", (~out["padding_mask"]).sum(-1).tolist())


if __name__ == "__main__":
    main()
