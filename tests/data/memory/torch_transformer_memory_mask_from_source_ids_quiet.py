# Correct: nn.TransformerEncoder / nn.TransformerDecoder (batch_first, left-padded sources, pad id 0). The encoder
# masks its padding and ends with a LayerNorm (its padded outputs are not zero, and nothing reads them as zeros); the
# decoder's memory_key_padding_mask is the source's own padding, `src == PAD`, so its cross-attention never sees it.
import torch
from torch import nn

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

    def forward(self, src, tgt):
        pad = src == PAD
        memory = self.encoder(self.embed(src), src_key_padding_mask=pad)
        n = tgt.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf")), 1)
        return self.out(self.decoder(self.embed(tgt), memory, tgt_mask=causal, memory_key_padding_mask=pad))


model = Summarizer()
src = torch.tensor([[0, 0, 0, 5, 6, 7, 2], [8, 9, 10, 11, 12, 13, 2], [0, 14, 15, 16, 17, 18, 2]])  # left-padded
tgt = torch.tensor([[1, 20, 21, 2], [1, 22, 23, 24], [1, 25, 26, 2]])
logits = model(src, tgt[:, :-1])
loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
loss.backward()
print("loss %.4f" % loss.item())
