# Correct: a seq2seq model (SDPA, an additive float mask filled with finfo.min, pad id 0) whose decoder mask is the
# outer product of the decoder input's padding (`tgt_input != pad`, on the query and the key axis) ANDed with causal.
# The padded query rows see no key (uniform weights over every key there), but they are padding: their outputs are
# never read (the loss ignores the pad targets). Every real query sees itself and the real keys before it.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
PAD = 0


class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h, self.qkv, self.o = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.h, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, n, d))


class Translator(nn.Module):
    def __init__(self, vocab=24, d=16, h=2):
        super().__init__()
        self.tgt_pad_idx = PAD
        self.tgt_embedding = nn.Embedding(vocab, d, padding_idx=PAD)
        self.decoder_self_attn = Attention(d, h)
        self.generator = nn.Linear(d, vocab)

    def forward(self, tgt_input, tgt_output):
        real = tgt_input != self.tgt_pad_idx
        t = tgt_input.shape[1]
        keep = real[:, None, :, None] & real[:, None, None, :] & torch.tril(torch.ones(t, t, dtype=torch.bool))
        bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float).min)
        y = self.decoder_self_attn(self.tgt_embedding(tgt_input), bias)
        return F.cross_entropy(self.generator(y).flatten(0, 1), tgt_output.flatten(), ignore_index=PAD)


model = Translator()
tgt = torch.tensor([[1, 14, 15, 16, 17, 2], [1, 18, 2, 0, 0, 0], [1, 19, 20, 21, 2, 0]])
loss = model(tgt[:, :-1], tgt[:, 1:])
loss.backward()
print("loss %.4f" % loss.item())
