# OptimalScale/LMFlow 9f668252 written another way: a MosaicBERT-style ALiBi encoder (bidirectional, right-padded,
# SDPA) handed its attention bias by an embedding function that holds the batch's attention_mask (1 = real) and built
# the bias from the ALiBi slopes alone; the fix fills the bias with -inf where a key is padding.
import math
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)


def alibi_slopes(n_heads):
    start = 2 ** (-8 / n_heads)
    return torch.tensor([start ** (i + 1) for i in range(n_heads)])


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.wqkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = self.wqkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class AlibiEncoder(nn.Module):
    def __init__(self, vocab=50, dim=24, heads=4, depth=2, max_len=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(SelfAttention(dim, heads) for _ in range(depth))
        pos = torch.arange(max_len)
        distance = -(pos[None, :] - pos[:, None]).abs().float()  # symmetric: an encoder
        self.register_buffer("alibi", alibi_slopes(heads)[:, None, None] * distance[None], persistent=False)

    def attention_bias(self, attention_mask):
        n = attention_mask.shape[1]
        bias = self.alibi[None, :, :n, :n].expand(attention_mask.shape[0], -1, -1, -1)
        if FIXED:
            bias = bias.masked_fill((attention_mask == 0)[:, None, None, :], float("-inf"))
        return bias

    def forward(self, input_ids, bias):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, bias)
        return h


lengths = [7, 4, 9]
L = max(lengths)
input_ids = torch.zeros(len(lengths), L, dtype=torch.long)
attention_mask = torch.zeros(len(lengths), L, dtype=torch.long)
for row, n in enumerate(lengths):
    input_ids[row, :n] = torch.randint(1, 50, (n,))
    attention_mask[row, :n] = 1


def embed(model, input_ids, attention_mask):
    return model(input_ids, model.attention_bias(attention_mask))


model = AlibiEncoder().eval()
with torch.no_grad():
    out = embed(model, input_ids, attention_mask)
    gap = max((out[row, :n] - embed(model, input_ids[row:row + 1, :n], attention_mask[row:row + 1, :n])[0]).abs().max().item()
              for row, n in enumerate(lengths))
print("max |padded batch - each row alone| on real tokens:", f"{gap:.6f}")
