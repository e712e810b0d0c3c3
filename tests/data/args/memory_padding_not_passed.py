"""A captioning decoder (nn.TransformerDecoder) over left-padded image-region memory whose forward is told the memory's
padding (memory_key_padding_mask) but does not hand it to the decoder: every caption token attends to the padded
regions. --fixed passes it on.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Captioner(nn.Module):
    def __init__(self, vocab=40, width=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerDecoderLayer(width, heads, dim_feedforward=32, batch_first=True, dropout=0.0)
        self.decoder = nn.TransformerDecoder(layer, num_layers=2)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, memory, memory_key_padding_mask=None):
        n = tokens.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.embed(tokens)
        if FIXED:
            x = self.decoder(x, memory, tgt_mask=causal, memory_key_padding_mask=memory_key_padding_mask)
        else:
            x = self.decoder(x, memory, tgt_mask=causal)
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = Captioner().eval()
    regions = torch.randn(3, 4, 16)
    padded = torch.tensor([[True, True, False, False], [False, False, False, False], [True, False, False, False]])
    tokens = torch.randint(1, 40, (3, 7))
    with torch.no_grad():
        logits = model(tokens, regions, memory_key_padding_mask=padded)
    print("logits", tuple(logits.shape))


if __name__ == "__main__":
    main()
