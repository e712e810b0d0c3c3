# The bug of pytorch/text#2096 (torchtext's T5 generate ran `encoder(inputs)` with no src_key_padding_mask), written
# another way: a sentence encoder whose forward takes its ids as `src` (nn.TransformerEncoder's name for its input)
# and an optional src_key_padding_mask, scored over a right-padded batch without the mask. The ids' padding is stated
# by the model's own embedding (padding_idx=PAD) and lies in one run at each row's end. `--fixed` hands the mask the
# ids say (`src.eq(PAD)`).
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
PAD = 3
torch.manual_seed(0)


class SentenceEncoder(nn.Module):
    def __init__(self, vocab: int = 20, dim: int = 16, heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        layer = nn.TransformerEncoderLayer(dim, heads, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, src, src_key_padding_mask=None):
        return self.encoder(self.embed(src), src_key_padding_mask=src_key_padding_mask)


sentences = [[5, 9, 12, 7, 8], [6, 11, 4], [10, 13, 14, 15]]
width = max(len(s) for s in sentences)
src = torch.tensor([s + [PAD] * (width - len(s)) for s in sentences])
model = SentenceEncoder().eval()
with torch.no_grad():
    hidden = model(src, src_key_padding_mask=src.eq(PAD)) if FIXED else model(src)
    real = src.ne(PAD).unsqueeze(-1).float()
    pooled = (hidden * real).sum(1) / real.sum(1)
print("pooled norms:", [round(v, 4) for v in pooled.norm(dim=-1).tolist()])
