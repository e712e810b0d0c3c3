# The bug of Synthyra/FastPLMs 0a5ffc4 (a padding mask built over the query and the key axes, so the padded
# positions' rows see no key and their softmax is NaN, which the next layer reads through the values) written
# another way: a retrieval encoder over left-padded passages builds an additive bias with
# torch.where(pair, 0, -inf) from the outer product of its real flags and adds it to einsum scores, three layers.
# The fix builds the bias from the key axis alone, so every row keeps its real keys.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def padding_bias(real):
    """(B, L) bools, True on real tokens -> (B, 1, L, L) additive bias: 0 where attended, -inf elsewhere."""
    if FIXED:
        pair = real[:, None, None, :].expand(-1, 1, real.shape[1], -1)
    else:
        pair = torch.einsum("bi,bj->bij", real.float(), real.float()).bool()[:, None]
    return torch.where(pair, 0.0, float("-inf"))


class Block(nn.Module):
    def __init__(self, width=24, heads=3):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x, bias):
        b, n, w = x.shape
        q, k, v = self.to_qkv(self.norm(x)).reshape(b, n, 3, self.heads, w // self.heads).unbind(2)
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * (w // self.heads) ** -0.5 + bias
        attn = logits.softmax(dim=-1)
        x = x + self.proj(torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, n, w))
        return x + self.mlp(x)


class PassageEncoder(nn.Module):
    def __init__(self, vocab=50, width=24, depth=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])

    def forward(self, input_ids, attention_mask):
        real = attention_mask.bool()
        bias = padding_bias(real)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, bias)
        return x[:, -1]  # the last token of each passage (real under left padding)


model = PassageEncoder().eval()
lengths = [8, 5, 3]
L = max(lengths)
input_ids = torch.zeros(len(lengths), L, dtype=torch.long)
attention_mask = torch.zeros(len(lengths), L, dtype=torch.long)
for i, n in enumerate(lengths):
    input_ids[i, L - n:] = torch.randint(1, 50, (n,))
    attention_mask[i, L - n:] = 1
with torch.no_grad():
    batched = model(input_ids, attention_mask)
    alone = torch.cat([model(input_ids[i:i + 1, L - n:], attention_mask[i:i + 1, L - n:]) for i, n in enumerate(lengths)])
print(f"NaN passage embeddings: {int(torch.isnan(batched).any(-1).sum())}")
print(f"max |batched - alone|: {(batched - alone).abs().max().item()}")
