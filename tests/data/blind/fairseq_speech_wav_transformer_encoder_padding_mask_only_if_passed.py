# facebookresearch/fairseq commit f8266159 ("fix padding of s2t_wav_transformer", #4629): SpeechWavTransformerEncoder
# built its frame padding mask only when a `padding_mask` argument was given; the seq2seq model calls
# encoder(src_tokens, src_lengths), so padded frames were attended by the encoder and by the decoder's cross-attention.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Args:
    conv_feature_layers = "[(16, 10, 5), (16, 3, 2)]"
    encoder_embed_dim = 16
    encoder_attention_heads = 2
    encoder_layers = 1
    decoder_layers = 1
    vocab_size = 20


class ConvFeatureExtractionModel(nn.Module):
    def __init__(self, conv_layers):
        super().__init__()
        in_d, blocks = 1, []
        for dim, k, stride in conv_layers:
            blocks.append(nn.Sequential(nn.Conv1d(in_d, dim, k, stride=stride, bias=False), nn.GELU()))
            in_d = dim
        self.conv_layers = nn.ModuleList(blocks)

    def forward(self, x):  # B x T -> B x C x T'
        x = x.unsqueeze(1)
        for conv in self.conv_layers:
            x = conv(x)
        return x


class TransformerEncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x, encoder_padding_mask):  # T x B x C
        y, _ = self.self_attn(x, x, x, key_padding_mask=encoder_padding_mask, need_weights=False)
        x = self.self_attn_layer_norm(x + y)
        return self.final_layer_norm(x + self.fc2(torch.relu(self.fc1(x))))


class SpeechWavTransformerEncoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.feature_enc_layers = eval(args.conv_feature_layers)
        self.embedding_dim = args.encoder_embed_dim
        self.subsample = ConvFeatureExtractionModel(self.feature_enc_layers)
        self.feat_layer_norm = nn.LayerNorm(self.feature_enc_layers[-1][0])
        self.feat_proj = nn.Linear(self.feature_enc_layers[-1][0], self.embedding_dim)
        self.embed_positions = nn.Conv1d(self.embedding_dim, self.embedding_dim, kernel_size=3, padding=1)
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(self.embedding_dim, args.encoder_attention_heads) for _ in range(args.encoder_layers)]
        )

    def _get_feat_extract_output_lengths(self, input_lengths):
        def _conv_out_length(input_length, kernel_size, stride):
            return torch.floor((input_length - kernel_size) / stride + 1)

        for i in range(len(self.feature_enc_layers)):
            input_lengths = _conv_out_length(input_lengths, self.feature_enc_layers[i][1], self.feature_enc_layers[i][2])
        return input_lengths.to(torch.long)

    def forward(self, src_tokens, src_lengths, padding_mask=None):
        features = self.subsample(src_tokens).transpose(1, 2)
        features = self.feat_proj(self.feat_layer_norm(features))

        if FIXED:
            if padding_mask is not None:
                input_lengths = (1 - padding_mask.long()).sum(-1)
            else:
                input_lengths = src_lengths
            # apply conv formula to get real output_lengths
            output_lengths = self._get_feat_extract_output_lengths(input_lengths)
            padding_mask = torch.zeros(features.shape[:2], dtype=features.dtype, device=features.device)
            padding_mask[(torch.arange(padding_mask.shape[0]), output_lengths - 1)] = 1
            padding_mask = (1 - padding_mask.flip([-1]).cumsum(-1).flip([-1])).bool()
        elif padding_mask is not None:
            input_lengths = (1 - padding_mask.long()).sum(-1)
            output_lengths = self._get_feat_extract_output_lengths(input_lengths)
            padding_mask = torch.zeros(features.shape[:2], dtype=features.dtype, device=features.device)
            padding_mask[(torch.arange(padding_mask.shape[0]), output_lengths - 1)] = 1
            padding_mask = (1 - padding_mask.flip([-1]).cumsum(-1).flip([-1])).bool()

        x = features + self.embed_positions(features.transpose(1, 2)).transpose(1, 2)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C
        for layer in self.layers:
            x = layer(x, padding_mask)
        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [padding_mask] if padding_mask is not None else [],  # B x T
        }


class TransformerDecoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        d = args.encoder_embed_dim
        self.embed_tokens = nn.Embedding(args.vocab_size, d)
        self.self_attn = nn.MultiheadAttention(d, args.encoder_attention_heads)
        self.encoder_attn = nn.MultiheadAttention(d, args.encoder_attention_heads)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.output_projection = nn.Linear(d, args.vocab_size, bias=False)

    def forward(self, prev_output_tokens, encoder_out):
        x = self.embed_tokens(prev_output_tokens).transpose(0, 1)
        t = x.size(0)
        future_mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        y, _ = self.self_attn(x, x, x, attn_mask=future_mask, need_weights=False)
        x = self.norm1(x + y)
        enc = encoder_out["encoder_out"][0]
        enc_pad = encoder_out["encoder_padding_mask"][0] if len(encoder_out["encoder_padding_mask"]) > 0 else None
        y, _ = self.encoder_attn(x, enc, enc, key_padding_mask=enc_pad, need_weights=False)
        x = self.norm2(x + y)
        return self.output_projection(x.transpose(0, 1))


class S2TTransformerModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.encoder = SpeechWavTransformerEncoder(args)
        self.decoder = TransformerDecoder(args)

    def forward(self, src_tokens, src_lengths, prev_output_tokens):
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        return self.decoder(prev_output_tokens, encoder_out)


model = S2TTransformerModel(Args()).eval()

# a collated batch of two waveforms of different length, zero-padded at the end (as the S2T dataset collater does)
waves = [torch.randn(400), torch.randn(260)]
src_lengths = torch.tensor([w.numel() for w in waves])
src_tokens = torch.zeros(len(waves), int(src_lengths.max()))
for i, w in enumerate(waves):
    src_tokens[i, : w.numel()] = w
prev_output_tokens = torch.tensor([[2, 7, 9, 4], [2, 5, 3, 11]])

with torch.no_grad():
    batched = model(src_tokens, src_lengths, prev_output_tokens)
    alone = model(waves[1][None], src_lengths[1:], prev_output_tokens[1:])
print(f"{'fixed' if FIXED else 'buggy'}: shorter utterance, max |logits(batched) - logits(alone)| = "
      f"{(batched[1] - alone[0]).abs().max().item():.2e}")
