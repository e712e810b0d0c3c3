# Written here (not a published bug): the mean-counts-padding rule written another way than UER-py#190. A small
# sentence encoder over a LEFT-padded batch (SDPA with a boolean key mask, True = attend) zeroes the padded positions
# with masked_fill and then pools with `.mean(-2)`: the mean divides by the padded length, so a sentence's vector
# shrinks with the padding the batch gives it. The fix divides the masked sum by each row's count of real tokens.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Encoder(nn.Module):
    def __init__(self, vocab=50, dim=24, heads=3, layers=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        h = self.embed(input_ids)
        keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, L): every query sees the real keys
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(h).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
            h = h + out(a.transpose(1, 2).reshape(b, n, -1))
        pad = ~attention_mask.bool()
        h = h.masked_fill(pad.unsqueeze(-1), 0.0)
        if FIXED:
            return h.sum(dim=-2) / attention_mask.sum(dim=-1, keepdim=True)
        return h.mean(dim=-2)


sentences = [[7, 12, 9], [3, 4, 5, 6, 8, 10, 11], [21, 22, 23, 24, 25]]
length = max(len(s) for s in sentences)
ids = torch.tensor([[0] * (length - len(s)) + s for s in sentences])
mask = (ids != 0).long()
model = Encoder().eval()
with torch.no_grad():
    batched = model(ids, mask)
    alone = torch.cat([model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in sentences])
print("batched vs alone, max difference per sentence:", [round(float(d), 4) for d in (batched - alone).abs().amax(-1)])
