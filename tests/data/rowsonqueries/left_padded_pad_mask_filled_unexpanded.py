# The same bug as vit-pytorch 4c89017 (ViViT's (b, f + 1) frame mask handed to SDPA as a 2-D mask), written another
# way: a sentence encoder in eager attention, its batch left-padded (True = padding), fills the (B, H, L, L) scores with
# the (B, L) key padding as it is; torch broadcasts it as (L, L), which runs because the batch is as long as each
# sentence, and query i of every sentence is masked with sentence i's padding. Fix: padding_mask[:, None, None, :].
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, padding_mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / (d // self.heads) ** 0.5
        fill = padding_mask[:, None, None, :] if FIXED else padding_mask
        scores = scores.masked_fill(fill, -1e9)
        weights = scores.softmax(dim=-1)
        return self.out(torch.einsum("bhij,bhjd->bhid", weights, v).transpose(1, 2).reshape(b, n, d))


class Encoder(nn.Module):
    def __init__(self, vocab=50, dim=16, heads=2, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.layers = nn.ModuleList(SelfAttention(dim, heads) for _ in range(depth))

    def forward(self, tokens):
        padding_mask = tokens == PAD  # (B, L), True = padding
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x, padding_mask)
        real = (~padding_mask).unsqueeze(-1).float()
        return (x * real).sum(1) / real.sum(1)


def left_pad(sentences, length):
    return torch.tensor([[PAD] * (length - len(s)) + s for s in sentences])


model = Encoder().eval()
sentences = [[5, 6], [7, 8, 9], [10, 11, 12, 13], [14]]
with torch.no_grad():
    batch = model(left_pad(sentences, 4))
    alone = torch.cat([model(torch.tensor([s])) for s in sentences])
print("max |batched - alone|:", float((batch - alone).abs().max()))
