# The DeepTab bug (OpenTabular/DeepTab commit d2abc5a) written another way: a hand-written feature-token transformer
# for tables (an AutoInt / SAINT-column style block) on F.scaled_dot_product_attention, handed its (batch, features,
# dim) tokens permuted to (features, batch, dim) as a sequence-first layer would want them, so the heads attend over
# the batch's samples. The program checks one sample run alone (keyword arguments, a tensor index). --fixed: no permute.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class FeatureAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, tokens):  # tokens: (batch, features, dim)
        x = tokens if FIXED else tokens.permute(1, 0, 2)  # the bug: sequence-first layout for a batch-first block
        n, length, dim = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, length, dim)
        y = y if FIXED else y.permute(1, 0, 2)
        return tokens + self.out(y)


class TableNet(nn.Module):
    def __init__(self, n_cont=4, vocab=(3, 5, 7), dim=16, depth=2):
        super().__init__()
        self.cont = nn.Parameter(torch.randn(n_cont, dim) * 0.2)
        self.cats = nn.ModuleList(nn.Embedding(v, dim) for v in vocab)
        self.blocks = nn.ModuleList(FeatureAttention(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 2)

    def forward(self, x_cont, x_cat):
        tokens = torch.cat([x_cont.unsqueeze(-1) * self.cont,
                            torch.stack([e(x_cat[:, j]) for j, e in enumerate(self.cats)], 1)], 1)
        for block in self.blocks:
            tokens = block(tokens)
        return self.head(tokens[:, 0])


model = TableNet().eval()
B = 5
x_cont = torch.randn(B, 4)
x_cat = torch.stack([torch.randint(0, v, (B,)) for v in (3, 5, 7)], 1)
with torch.no_grad():
    batch = model(x_cont=x_cont, x_cat=x_cat)
    one = model(x_cont=x_cont[[2]], x_cat=x_cat[[2]])
print(f"|batch[2] - sample 2 alone|: {(batch[2] - one[0]).abs().max().item():.3e}")
