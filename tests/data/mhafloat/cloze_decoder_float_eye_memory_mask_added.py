# Written another way (the bug of parseq 056c792's ABINet port, BCN's location mask filled with True (+1.0) where
# -inf was meant): a cloze-style spelling corrector on nn.TransformerDecoder, batch_first, over a right-padded batch
# of words. Its own-position mask `torch.eye(T)` is handed as the float `memory_mask`, which each cross-attention adds
# to its scores: +1 on a position's own character masks nothing, so every position reads the character it is asked to
# restore. The fix hands the bool eye (True = masked), as nn.MultiheadAttention reads one.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

VOCAB, PAD, D = 20, 0, 32


class ClozeCorrector(nn.Module):
    def __init__(self, max_len=10):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(max_len, D) * 0.1)
        layer = nn.TransformerDecoderLayer(D, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=2)
        self.out = nn.Linear(D, VOCAB)

    def own_position_mask(self, T):
        if FIXED:
            return torch.eye(T, dtype=torch.bool)
        return torch.eye(T)  # float: 1.0 on the diagonal, added to the scores

    def forward(self, chars):
        B, T = chars.shape
        pad = chars == PAD
        memory = self.embed(chars) + self.pos[:T]
        queries = self.pos[:T].expand(B, T, D)
        out = self.decoder(queries, memory, memory_mask=self.own_position_mask(T), tgt_key_padding_mask=pad,
                           memory_key_padding_mask=pad)
        return self.out(out)


model = ClozeCorrector().eval()
words = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, PAD, PAD, PAD]])
with torch.no_grad():
    logits = model(words)
    changed = words.clone()
    changed[:, 2] = 3
    moved = (model(changed)[:, 2] - logits[:, 2]).abs().max().item()
print(f"change at position 2 when only its own character changes: {moved:.3e}")
