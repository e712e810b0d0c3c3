# The same kind of bug as bert4keras 184f10d, written another way: nn.TransformerEncoder / nn.TransformerDecoder
# (batch_first, left-padded sources, pad id 0), whose decoder finds the memory's padding as Keras' Masking layer does:
# a memory position is padding where its vector is all zeros (`memory_key_padding_mask = (memory == 0).all(-1)`).
# The encoder masks its padding (src_key_padding_mask) but ends with a LayerNorm, so its padded outputs are not zero:
# the memory mask keeps every key and the decoder's cross-attention reads the padded source. --fixed: the encoder's
# outputs are zeroed at its padding (masked_fill) before the decoder reads them, as bert4keras' fix does.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, D = 0, 16


class Summarizer(nn.Module):
    def __init__(self, vocab=30):
        super().__init__()
        self.embed = nn.Embedding(vocab, D, padding_idx=PAD)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 2, 32, batch_first=True), 2,
                                             norm=nn.LayerNorm(D), enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, 2, 32, batch_first=True), 2)
        self.out = nn.Linear(D, vocab)

    def encode(self, src):
        pad = src == PAD
        memory = self.encoder(self.embed(src), src_key_padding_mask=pad)
        if FIXED:
            memory = memory.masked_fill(pad[..., None], 0.0)
        return memory

    def decode(self, memory, tgt):
        memory_pad = (memory == 0).all(-1)  # Masking(mask_value=0.0): padding is a zero vector
        n = tgt.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf")), 1)
        h = self.decoder(self.embed(tgt), memory, tgt_mask=causal, memory_key_padding_mask=memory_pad)
        return self.out(h)

    def forward(self, src, tgt):
        return self.decode(self.encode(src), tgt)


model = Summarizer()
src = torch.tensor([[0, 0, 0, 5, 6, 7, 2], [8, 9, 10, 11, 12, 13, 2], [0, 14, 15, 16, 17, 18, 2]])  # left-padded
tgt = torch.tensor([[1, 20, 21, 2], [1, 22, 23, 24], [1, 25, 26, 2]])
logits = model(src, tgt[:, :-1])
loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
loss.backward()
print("loss %.4f" % loss.item())
