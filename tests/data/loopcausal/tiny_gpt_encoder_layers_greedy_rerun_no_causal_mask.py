# Written here (not a published bug): loop-sees-later written another way than candle#1146. A decoder-only "TinyGPT"
# built from nn.TransformerEncoderLayer is sampled greedily by re-running the whole sequence each step (no cache), a
# batch of two prompts of 3 tokens, 5 steps. Its forward passes no causal mask, so every token's state sees the tokens
# appended after it. The fix passes nn.Transformer.generate_square_subsequent_mask(L).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyGPT(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4, layers=2, max_len=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 64, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        length = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(length))
        mask = nn.Transformer.generate_square_subsequent_mask(length) if FIXED else None
        return self.head(self.blocks(x, mask=mask, is_causal=FIXED))


model = TinyGPT().eval()
idx = torch.tensor([[5, 9, 2], [7, 3, 11]])
with torch.no_grad():
    for _ in range(5):
        logits = model(idx)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    final = model(idx)
print("generated:", idx.tolist())
print("first position's logits at the end:", [round(float(v), 4) for v in final[0, 0, :4]])
