"""ajhalthor Transformer-Neural-Network: create_masks leaves the first padding slot open.

Citation: ajhalthor/Transformer-Neural-Network#15 ("Padding mask indices error", open; a second
commenter agrees and adds that the Kannada side is off in another way because of its start and
end tokens). Source read from Transformer_Trainer_Notebook.ipynb at the stored HEAD.

Bug: `create_masks(eng_batch, kn_batch)` marks padding with
`np.arange(eng_sentence_length + 1, max_sequence_length)`. The English encoder input is built
with `enc_start_token=False, enc_end_token=False`, so its padding starts at index
`eng_sentence_length`; the `+ 1` leaves that first padding position unmasked, both as a key of
the encoder self-attention and as a key of the decoder's cross-attention (and as a query row).
Every English character therefore attends one padding token. Fix (the issue's): `np.arange(
eng_sentence_length, max_sequence_length)`. `--fixed` applies it to the English side only; the
Kannada side, which carries a start and an end token, is left as the notebook has it because the
thread shows the issue's one-line change is not right there either.

The program keeps the notebook's shapes: character tokenization padded to `max_sequence_length`,
`NEG_INFTY = -1e9` additive masks from `torch.where`, the tutorial's `scaled_dot_product`
(q @ k.T / sqrt(d_k) + mask, softmax), one encoder layer and one decoder cross-attention.
"""
import math
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

NEG_INFTY = -1e9
max_sequence_length = 12
START_TOKEN, PADDING_TOKEN, END_TOKEN = "<START>", "<PADDING>", "<END>"
english_vocabulary = [START_TOKEN, " ", "?", *"abcdefghijklmnopqrstuvwxyz", PADDING_TOKEN, END_TOKEN]
kannada_vocabulary = [START_TOKEN, " ", "?", *"ಅಆಇಈಉಊಋಎಏಐಒಓಔಕಖಗಘ", PADDING_TOKEN, END_TOKEN]
english_to_index = {v: k for k, v in enumerate(english_vocabulary)}
kannada_to_index = {v: k for k, v in enumerate(kannada_vocabulary)}


def create_masks(eng_batch, kn_batch):
    num_sentences = len(eng_batch)
    look_ahead_mask = torch.full([max_sequence_length, max_sequence_length], True)
    look_ahead_mask = torch.triu(look_ahead_mask, diagonal=1)
    encoder_padding_mask = torch.full([num_sentences, max_sequence_length, max_sequence_length], False)
    decoder_padding_mask_self_attention = torch.full([num_sentences, max_sequence_length, max_sequence_length], False)
    decoder_padding_mask_cross_attention = torch.full([num_sentences, max_sequence_length, max_sequence_length], False)

    for idx in range(num_sentences):
        eng_sentence_length, kn_sentence_length = len(eng_batch[idx]), len(kn_batch[idx])
        if FIXED:
            eng_chars_to_padding_mask = np.arange(eng_sentence_length, max_sequence_length)
        else:
            eng_chars_to_padding_mask = np.arange(eng_sentence_length + 1, max_sequence_length)
        kn_chars_to_padding_mask = np.arange(kn_sentence_length + 1, max_sequence_length)
        encoder_padding_mask[idx, :, eng_chars_to_padding_mask] = True
        encoder_padding_mask[idx, eng_chars_to_padding_mask, :] = True
        decoder_padding_mask_self_attention[idx, :, kn_chars_to_padding_mask] = True
        decoder_padding_mask_self_attention[idx, kn_chars_to_padding_mask, :] = True
        decoder_padding_mask_cross_attention[idx, :, eng_chars_to_padding_mask] = True
        decoder_padding_mask_cross_attention[idx, kn_chars_to_padding_mask, :] = True

    encoder_self_attention_mask = torch.where(encoder_padding_mask, NEG_INFTY, 0)
    decoder_self_attention_mask = torch.where(look_ahead_mask + decoder_padding_mask_self_attention, NEG_INFTY, 0)
    decoder_cross_attention_mask = torch.where(decoder_padding_mask_cross_attention, NEG_INFTY, 0)
    return encoder_self_attention_mask, decoder_self_attention_mask, decoder_cross_attention_mask


def scaled_dot_product(q, k, v, mask=None):
    d_k = q.size()[-1]
    scaled = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d_k)
    if mask is not None:
        scaled = scaled.permute(1, 0, 2, 3) + mask
        scaled = scaled.permute(1, 0, 2, 3)
    attention = F.softmax(scaled, dim=-1)
    return torch.matmul(attention, v), attention


class SentenceEmbedding(nn.Module):
    def __init__(self, d_model, language_to_index):
        super().__init__()
        self.language_to_index = language_to_index
        self.embedding = nn.Embedding(len(language_to_index), d_model)

    def batch_tokenize(self, batch, start_token, end_token):
        def tokenize(sentence):
            idx = [self.language_to_index[t] for t in list(sentence)]
            if start_token:
                idx.insert(0, self.language_to_index[START_TOKEN])
            if end_token:
                idx.append(self.language_to_index[END_TOKEN])
            while len(idx) < max_sequence_length:
                idx.append(self.language_to_index[PADDING_TOKEN])
            return torch.tensor(idx)
        return torch.stack([tokenize(s) for s in batch])

    def forward(self, x, start_token, end_token):
        return self.embedding(self.batch_tokenize(x, start_token, end_token))


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.qkv_layer = nn.Linear(d_model, 3 * d_model)
        self.linear_layer = nn.Linear(d_model, d_model)

    def forward(self, x, mask):
        b, n, d = x.size()
        qkv = self.qkv_layer(x).reshape(b, n, self.num_heads, 3 * self.head_dim).permute(0, 2, 1, 3)
        q, k, v = qkv.chunk(3, dim=-1)
        values, attention = scaled_dot_product(q, k, v, mask)
        return self.linear_layer(values.permute(0, 2, 1, 3).reshape(b, n, d))


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.kv_layer = nn.Linear(d_model, 2 * d_model)
        self.q_layer = nn.Linear(d_model, d_model)
        self.linear_layer = nn.Linear(d_model, d_model)

    def forward(self, x, y, mask):
        b, n, d = x.size()
        kv = self.kv_layer(x).reshape(b, n, self.num_heads, 2 * self.head_dim).permute(0, 2, 1, 3)
        q = self.q_layer(y).reshape(b, n, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        k, v = kv.chunk(2, dim=-1)
        values, attention = scaled_dot_product(q, k, v, mask)
        return self.linear_layer(values.permute(0, 2, 1, 3).reshape(b, n, d))


class Transformer(nn.Module):
    def __init__(self, d_model=16, num_heads=2):
        super().__init__()
        self.enc_embedding = SentenceEmbedding(d_model, english_to_index)
        self.dec_embedding = SentenceEmbedding(d_model, kannada_to_index)
        self.encoder_attention = MultiHeadAttention(d_model, num_heads)
        self.decoder_self_attention = MultiHeadAttention(d_model, num_heads)
        self.decoder_cross_attention = MultiHeadCrossAttention(d_model, num_heads)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x, y, encoder_self_attention_mask, decoder_self_attention_mask,
                decoder_cross_attention_mask, enc_start_token=False, enc_end_token=False,
                dec_start_token=False, dec_end_token=False):
        x = self.enc_embedding(x, enc_start_token, enc_end_token)
        x = self.norm(x + self.encoder_attention(x, encoder_self_attention_mask))
        y = self.dec_embedding(y, dec_start_token, dec_end_token)
        y = self.norm(y + self.decoder_self_attention(y, decoder_self_attention_mask))
        return self.norm(y + self.decoder_cross_attention(x, y, decoder_cross_attention_mask))


def main():
    torch.manual_seed(0)
    transformer = Transformer().eval()
    eng_batch = ("hi there?", "go now")
    kn_batch = ("ಅಆಇಈ", "ಕಖ")
    masks = create_masks(eng_batch, kn_batch)
    with torch.no_grad():
        out = transformer(eng_batch, kn_batch, *masks, enc_start_token=False, enc_end_token=False,
                          dec_start_token=True, dec_end_token=True)
    print("decoder out", tuple(out.shape), "%.4f" % out[1].abs().mean().item())


if __name__ == "__main__":
    main()
