"""A Longformer-style encoder called as LED takes it: `attention_mask` (1 = a real token, a right-padded batch) and a
`global_attention_mask` (1 = global: each row's first token and a question token). Its layers build the sliding band
|i - j| <= 2 over the real tokens for SDPA and never add the global tokens; --fixed: a global token sees, and is
seen by, every real token of its row."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Layer(torch.nn.Module):
    def __init__(self, dim=16, heads=2, window=2):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None]).transpose(1, 2).reshape(b, n, d)


class Encoder(torch.nn.Module):
    def __init__(self, vocab=40, dim=16, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Layer(dim) for _ in range(layers))

    def forward(self, input_ids, attention_mask, global_attention_mask):
        n = input_ids.shape[1]
        at = torch.arange(n)
        real = attention_mask.bool()
        keep = ((at[None, :] - at[:, None]).abs() <= 2)[None] & real[:, None, :] & real[:, :, None]
        if FIXED:
            wide = global_attention_mask.bool()
            keep = keep | (real[:, :, None] & real[:, None, :] & (wide[:, :, None] | wide[:, None, :]))
        keep = keep | torch.eye(n, dtype=torch.bool)[None]  # (a pad query sees itself: no empty row)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, keep)
        return x


if __name__ == "__main__":
    torch.manual_seed(0)
    ids = torch.randint(2, 40, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    wide = torch.zeros(2, 10, dtype=torch.long)
    wide[:, 0] = 1
    wide[0, 3] = 1
    with torch.no_grad():
        print(Encoder().eval()(ids, mask, wide).shape)
