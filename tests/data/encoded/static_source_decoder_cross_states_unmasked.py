"""An exported encoder-decoder run as two graphs with a static source length: the source is padded with the pad id to
MAX_SOURCE = 12 and the encoder masks those rows out of its own self-attention with a bool key mask. The decoder graph
is handed the encoder's rows as `cross_hidden_states` and their mask as `cross_key_mask`; buggy, its layer drops the
mask at the cross-attention (scores over all 12 rows, the source's pad rows among them); fixed, it fills them with
-inf. Written after NVIDIA/TensorRT-Model-Connect cc55eb1 (BART decoder cross-attention with no encoder padding mask)
in another style: a batch of two sources of other lengths, an eager softmax, the whole target teacher-forced."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, HEADS, VOCAB, PAD, MAX_SOURCE = 16, 2, 30, 0, 12


def heads(x):
    b, n, _ = x.shape
    return x.view(b, n, HEADS, D // HEADS).transpose(1, 2)


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.norm = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, x, key_real):
        q, k, v = (heads(t) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_real[:, None, None, :])
        return self.norm(x + self.out(y.transpose(1, 2).flatten(2)))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_qkv, self.cross_q, self.cross_kv = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Linear(D, 2 * D)
        self.out1, self.out2, self.norm1, self.norm2 = nn.Linear(D, D), nn.Linear(D, D), nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x, cross_hidden_states, cross_key_mask):
        n = x.shape[1]
        q, k, v = (heads(t) for t in self.self_qkv(x).chunk(3, -1))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2)) / (D // HEADS) ** 0.5
        x = self.norm1(x + self.out1((scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).flatten(2)))
        q = heads(self.cross_q(x))
        k, v = (heads(t) for t in self.cross_kv(cross_hidden_states).chunk(2, -1))
        scores = (q @ k.transpose(-1, -2)) / (D // HEADS) ** 0.5
        if FIXED:
            scores = scores.masked_fill(~cross_key_mask[:, None, None, :], float("-inf"))
        y = scores.softmax(-1) @ v
        return self.norm2(x + self.out2(y.transpose(1, 2).flatten(2)))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.layers = nn.Embedding(VOCAB, D), nn.ModuleList([EncoderLayer() for _ in range(2)])

    def forward(self, src_ids):
        key_real = src_ids != PAD
        x = self.embed(src_ids)
        for layer in self.layers:
            x = layer(x, key_real)
        return x, key_real


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.layers = nn.Embedding(VOCAB, D), nn.ModuleList([DecoderLayer() for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tgt_ids, cross_hidden_states, cross_key_mask):
        x = self.embed(tgt_ids)
        for layer in self.layers:
            x = layer(x, cross_hidden_states, cross_key_mask)
        return self.head(x)


encoder, decoder = Encoder().eval(), Decoder().eval()
lengths = (5, 9)
src = torch.full((2, MAX_SOURCE), PAD)
for row, n in enumerate(lengths):
    src[row, :n] = torch.randint(1, VOCAB, (n,))
tgt = torch.randint(1, VOCAB, (2, 6))
with torch.no_grad():
    memory, real = encoder(src)
    logits = decoder(tgt, memory, real)
print(logits.shape)
