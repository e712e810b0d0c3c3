"""A hand-written GPT-2 with a sliding window over a left-padded batch of one row, greedy without a cache: the window
filled with GPT-2's masked_bias (-1e4, torch.where), the padding added as (1 - attention_mask) * -1e4. The last
padding query within reach of real keys sees its own padding keys in the window (-1e4 + its score) and the real keys
after it (-1e4) alike, but not the padding keys before its window (-2e4): a padding row, whose output is never used,
that the model call's attention_mask states. With --buggy the window's band is built one key off (tril(diagonal=1)):
the real queries see the next token.
"""
import sys

import torch
from torch import nn

BUGGY = "--buggy" in sys.argv
WINDOW = 3


class Block(nn.Module):
    def __init__(self, width=16, heads=2, context=12):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        ones = torch.ones(context, context)
        band = torch.tril(ones, diagonal=1 if BUGGY else 0).bool() & ~torch.tril(ones, diagonal=-WINDOW).bool()
        self.register_buffer("bias", band.bool()[None, None])
        self.register_buffer("masked_bias", torch.tensor(-1e4))

    def forward(self, x, extended):  # extended (B, 1, 1, T): 0 on a real key, -1e4 on padding
        b, t, c = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        w = torch.matmul(q, k.transpose(-1, -2)) / float(v.size(-1)) ** 0.5
        w = torch.where(self.bias[:, :, :t, :t], w, self.masked_bias.to(w.dtype))
        w = nn.functional.softmax(w + extended, dim=-1)
        return x + self.c_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, t, c))


class TinyGPT2(nn.Module):
    def __init__(self, vocab=20, width=16, layers=2, context=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, context=context) for _ in range(layers))
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask):
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # a left-padded row counts from its first real token
        x = self.wte(input_ids) + self.wpe(positions)
        extended = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for block in self.h:
            x = block(x, extended)
        return self.lm_head(x)


def main():
    torch.manual_seed(0)
    model = TinyGPT2().eval()
    ids = torch.tensor([[0, 0, 0, 0, 5, 6, 7, 8]])
    attention_mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        for _ in range(2):
            token = model(ids, attention_mask=attention_mask)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
    print("generated", ids[0, 8:].tolist())


if __name__ == "__main__":
    main()
