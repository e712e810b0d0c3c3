"""A batch_first=True encoder handed the embeddings transposed to (seq, batch, embed): it attends across the batch.

Written for maskcli's tests (checks/batchaxis.py, batch-axis-attended), Molecule-Generator#22 written the other way
round: the model keeps its pad id in a config object (`self.config.pad_token_id = 0`), the batch is left-padded and
named `tokens`, and the layers are batch_first=True, but `forward` transposes the embeddings to the old (S, N, E)
layout before them, so each position attends the same position of the other sequences. `--fixed` drops the
transpose and hands the padding as src_key_padding_mask.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class TextEncoder(nn.Module):
    def __init__(self, vocab=32, dim=16, heads=2, layers=2):
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=0, hidden_size=dim)
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        if FIXED:
            return self.encoder(x, src_key_padding_mask=tokens == self.config.pad_token_id)
        return self.encoder(x.transpose(0, 1)).transpose(0, 1)  # (S, N, E), as for a batch_first=False layer


if __name__ == "__main__":
    torch.manual_seed(0)
    tokens = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 13, 14, 15, 16], [0, 0, 0, 17, 18]])
    with torch.no_grad():
        out = TextEncoder().eval()(tokens)
    print("fixed" if FIXED else "buggy", tuple(out.shape))
