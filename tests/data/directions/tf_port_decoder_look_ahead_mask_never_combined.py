# The slip of graykode/nlp-tutorial 5b4fb5e written another way: a PyTorch port of the TensorFlow "Transformer model
# for language understanding" tutorial. The decoder's first attention (mha1) is handed no mask at all during teacher
# forcing, though create_look_ahead_mask sits beside the Decoder; its second (mha2) attends a right-padded source as
# long as the targets, masked by the source padding. The fix hands mha1 max(look-ahead mask, target padding mask).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def create_padding_mask(seq):
    return (seq == 0).float()[:, None, None, :]  # (B, 1, 1, L): 1 = padding


def create_look_ahead_mask(size):
    return torch.triu(torch.ones(size, size), diagonal=1)  # 1 = a later token


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.depth = num_heads, d_model // num_heads
        self.wq, self.wk, self.wv = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.dense = nn.Linear(d_model, d_model)

    def split_heads(self, x):
        return x.view(x.size(0), -1, self.num_heads, self.depth).transpose(1, 2)

    def forward(self, query, key, value, mask):
        q, k, v = self.split_heads(self.wq(query)), self.split_heads(self.wk(key)), self.split_heads(self.wv(value))
        scaled = q @ k.transpose(-1, -2) / self.depth ** 0.5
        if mask is not None:
            scaled = scaled + mask * -1e9
        weights = torch.softmax(scaled, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(query.size(0), -1, self.num_heads * self.depth)
        return self.dense(out)


class DecoderLayer(nn.Module):
    def __init__(self, d_model, num_heads, dff):
        super().__init__()
        self.mha1, self.mha2 = MultiHeadAttention(d_model, num_heads), MultiHeadAttention(d_model, num_heads)
        self.ffn = nn.Sequential(nn.Linear(d_model, dff), nn.ReLU(), nn.Linear(dff, d_model))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(3))

    def forward(self, x, enc_output, look_ahead_mask, padding_mask):
        out1 = self.norms[0](x + self.mha1(x, x, x, look_ahead_mask))
        out2 = self.norms[1](out1 + self.mha2(out1, enc_output, enc_output, padding_mask))
        return self.norms[2](out2 + self.ffn(out2))


class Decoder(nn.Module):
    def __init__(self, num_layers, d_model, num_heads, dff, vocab):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.dec_layers = nn.ModuleList(DecoderLayer(d_model, num_heads, dff) for _ in range(num_layers))

    def forward(self, tar, enc_output, look_ahead_mask, padding_mask):
        x = self.embedding(tar)
        for layer in self.dec_layers:
            x = layer(x, enc_output, look_ahead_mask, padding_mask)
        return x


class Transformer(nn.Module):
    def __init__(self, vocab=30, d_model=32, num_heads=4, dff=64, num_layers=2):
        super().__init__()
        self.src_embedding = nn.Embedding(vocab, d_model)
        self.decoder = Decoder(num_layers, d_model, num_heads, dff, vocab)
        self.final = nn.Linear(d_model, vocab)

    def forward(self, inp, tar):
        enc_output = self.src_embedding(inp)  # (the encoder left out: the decoder's masks are the point)
        dec_padding_mask = create_padding_mask(inp)
        if FIXED:
            look_ahead = create_look_ahead_mask(tar.size(1))
            combined_mask = torch.maximum(create_padding_mask(tar), look_ahead)
        else:
            combined_mask = None
        return self.final(self.decoder(tar, enc_output, combined_mask, dec_padding_mask))


model = Transformer()
inp = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0]])  # right-padded sources, as long as the targets
tar = torch.tensor([[1, 12, 13, 14, 15, 16], [1, 17, 18, 19, 0, 0]])  # right-padded targets
logits = model(inp, tar)
changed = tar.clone()
changed[0, -1] = 20
leak = (model(inp, changed) - logits)[0, :-1].abs().max().item()
loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 30), tar[:, 1:].reshape(-1), ignore_index=0)
loss.backward()
print(f"loss = {loss.item():.4f}; change to the last target moves earlier outputs by {leak:.6f}")
