"""A translation model on nn.Transformer whose training forward hands the decoder its padding but no causal mask.

The model takes `input_ids` (source) and `decoder_input_ids` (the target shifted right behind a start token, as
transformers' seq2seq models take them) and computes its loss against `labels`, the target itself: decoder position i
predicts decoder input i + 1. Source and target are padded to the same length, so the encoder's and the decoder's
self-attention have one shape; the encoder attends both ways, as it should. The bug: `tgt_mask` is never built, so
decoder query i sees the decoder inputs after it, its own answer among them. `--fixed` hands
`nn.Transformer.generate_square_subsequent_mask`.
"""

import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, START, VOCAB, D = 0, 1, 32, 32


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.transformer = nn.Transformer(D, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                                          dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids, decoder_input_ids, labels=None):
        length = decoder_input_ids.shape[1]
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.bool) if FIXED else None
        out = self.transformer(self.embed(input_ids), self.embed(decoder_input_ids), tgt_mask=tgt_mask,
                               src_key_padding_mask=input_ids == PAD, tgt_key_padding_mask=decoder_input_ids == PAD,
                               memory_key_padding_mask=input_ids == PAD)
        logits = self.head(out)
        loss = None if labels is None else nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                                                       ignore_index=-100)
        return logits, loss


model = Seq2Seq().train()
source = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
target = torch.tensor([[20, 21, 22, 23, 24, 2], [25, 26, 2, 0, 0, 0]])
labels = target.masked_fill(target == PAD, -100)
decoder_input_ids = torch.cat([torch.full((2, 1), START), target[:, :-1]], dim=1)
logits, loss = model(source, decoder_input_ids, labels=labels)
loss.backward()
print(f"loss {loss.item():.6f}")
