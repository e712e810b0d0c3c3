# hkproj/pytorch-transformer#19: translate.py builds the greedy-decoding target mask as
# torch.triu(ones, diagonal=1) (1 above the diagonal) while the model masks where mask == 0, so every target
# position sees only its future tokens instead of its past; training's causal_mask() compares with == 0.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LayerNormalization(nn.Module):
    def __init__(self, eps: float = 10**-6) -> None:
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        std = x.std(dim=-1, keepdim=True)
        return self.alpha * (x - mean) / (std + self.eps) + self.bias


class MultiHeadAttentionBlock(nn.Module):
    def __init__(self, d_model: int, h: int) -> None:
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.w_q, self.w_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.w_v, self.w_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    @staticmethod
    def attention(query, key, value, mask):
        d_k = query.shape[-1]
        attention_scores = (query @ key.transpose(-2, -1)) / math.sqrt(d_k)
        if mask is not None:
            # Write a very low value (indicating -inf) to the positions where mask == 0
            attention_scores.masked_fill_(mask == 0, -1e9)
        attention_scores = attention_scores.softmax(dim=-1)
        return attention_scores @ value

    def forward(self, q, k, v, mask):
        b = q.shape[0]
        query = self.w_q(q).view(b, -1, self.h, self.d_k).transpose(1, 2)
        key = self.w_k(k).view(b, -1, self.h, self.d_k).transpose(1, 2)
        value = self.w_v(v).view(b, -1, self.h, self.d_k).transpose(1, 2)
        x = MultiHeadAttentionBlock.attention(query, key, value, mask)
        x = x.transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.w_o(x)


class FeedForwardBlock(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.linear_2(torch.relu(self.linear_1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, d_model, h, d_ff):
        super().__init__()
        self.self_attention_block = MultiHeadAttentionBlock(d_model, h)
        self.feed_forward_block = FeedForwardBlock(d_model, d_ff)
        self.norms = nn.ModuleList([LayerNormalization() for _ in range(2)])

    def forward(self, x, src_mask):
        x = x + self.self_attention_block(self.norms[0](x), self.norms[0](x), self.norms[0](x), src_mask)
        return x + self.feed_forward_block(self.norms[1](x))


class DecoderBlock(nn.Module):
    def __init__(self, d_model, h, d_ff):
        super().__init__()
        self.self_attention_block = MultiHeadAttentionBlock(d_model, h)
        self.source_attention_block = MultiHeadAttentionBlock(d_model, h)
        self.feed_forward_block = FeedForwardBlock(d_model, d_ff)
        self.norms = nn.ModuleList([LayerNormalization() for _ in range(3)])

    def forward(self, x, encoder_output, src_mask, tgt_mask):
        n = self.norms[0](x)
        x = x + self.self_attention_block(n, n, n, tgt_mask)
        x = x + self.source_attention_block(self.norms[1](x), encoder_output, encoder_output, src_mask)
        return x + self.feed_forward_block(self.norms[2](x))


class Transformer(nn.Module):
    def __init__(self, src_vocab_size, tgt_vocab_size, seq_len, d_model=16, N=2, h=2, d_ff=32):
        super().__init__()
        self.d_model = d_model
        self.src_embed = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model)
        pe = torch.zeros(seq_len, d_model)
        position = torch.arange(0, seq_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div_term), torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))
        self.encoder = nn.ModuleList([EncoderBlock(d_model, h, d_ff) for _ in range(N)])
        self.decoder = nn.ModuleList([DecoderBlock(d_model, h, d_ff) for _ in range(N)])
        self.enc_norm, self.dec_norm = LayerNormalization(), LayerNormalization()
        self.proj = nn.Linear(d_model, tgt_vocab_size)

    def encode(self, src, src_mask):
        x = self.src_embed(src) * math.sqrt(self.d_model) + self.pe[:, : src.shape[1]]
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x)

    def decode(self, encoder_output, src_mask, tgt, tgt_mask):
        x = self.tgt_embed(tgt) * math.sqrt(self.d_model) + self.pe[:, : tgt.shape[1]]
        for layer in self.decoder:
            x = layer(x, encoder_output, src_mask, tgt_mask)
        return self.dec_norm(x)

    def project(self, x):
        return torch.log_softmax(self.proj(x), dim=-1)


def causal_mask(size):
    mask = torch.triu(torch.ones((1, size, size)), diagonal=1).type(torch.int)
    return mask == 0


SOS, EOS, PAD = 1, 2, 0
seq_len = 12
model = Transformer(src_vocab_size=30, tgt_vocab_size=30, seq_len=seq_len).eval()

# translate.py: one sentence, padded to seq_len
ids = [7, 12, 5, 19, 23]
source = torch.tensor([SOS] + ids + [EOS] + [PAD] * (seq_len - len(ids) - 2), dtype=torch.int64)
source_mask = (source != PAD).unsqueeze(0).unsqueeze(0).int()

with torch.no_grad():
    encoder_output = model.encode(source.unsqueeze(0), source_mask)
    decoder_input = torch.empty(1, 1).fill_(SOS).type_as(source)
    worst = 0.0
    while decoder_input.size(1) < 8:
        # build mask for target and calculate output
        if FIXED:
            decoder_mask = causal_mask(decoder_input.size(1)).type_as(source_mask)
        else:
            decoder_mask = torch.triu(torch.ones((1, decoder_input.size(1), decoder_input.size(1))), diagonal=1).type(torch.int).type_as(source_mask)
        out = model.decode(encoder_output, source_mask, decoder_input, decoder_mask)
        prob = model.project(out[:, -1])
        # what training (causal_mask from model.py) gives for the same prefix
        ref = model.project(model.decode(encoder_output, source_mask, decoder_input, causal_mask(decoder_input.size(1)).type_as(source_mask))[:, -1])
        worst = max(worst, (prob - ref).abs().max().item())
        _, next_word = torch.max(prob, dim=1)
        decoder_input = torch.cat([decoder_input, torch.empty(1, 1).type_as(source).fill_(next_word.item())], dim=1)
        if next_word == EOS:
            break

print(f"{'fixed' if FIXED else 'buggy'}: decoded {decoder_input[0].tolist()}; "
      f"max |log-probs - causal reference| over steps = {worst:.3e}")
