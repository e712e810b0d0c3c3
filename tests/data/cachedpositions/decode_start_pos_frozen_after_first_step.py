"""A hand-written rotary decoder whose greedy loop numbers every decode step at the prompt's length.

The model takes an int `start_pos` as Meta's Llama reference does and keeps its cache as a tuple of (k, v) per
layer, grown by torch.cat. The loop computes the position of the first new token once, before it, and never advances it:
the first decode step is at the right place, every later one is rotated at that same position while the cache holds
the tokens decoded before it there (the second step's query sits at the first step's key). The fix advances the
position by one a step.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DIM, HEADS, LAYERS, VOCAB = 32, 4, 2, 40


def rotate(x, start_pos):
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.arange(start_pos, start_pos + x.shape[2])[:, None].float() * freqs  # (L, half)
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, start_pos, past=None):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, start_pos), rotate(k, start_pos)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        causal = torch.ones(length, k.shape[2], dtype=torch.bool).tril(k.shape[2] - length)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        return self.out(y.transpose(1, 2).reshape(b, length, DIM)), (k, v)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, start_pos, past=None):
        h, present = self.attn(self.norm1(x), start_pos, past)
        x = x + h
        return x + self.mlp(self.norm2(x)), present


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, start_pos, past_key_values=None):
        x = self.embed(tokens)
        presents = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, start_pos, None if past_key_values is None else past_key_values[i])
            presents.append(present)
        return self.head(x), tuple(presents)


@torch.no_grad()
def greedy(model, prompt, new_tokens):
    logits, past = model(prompt, 0)
    tokens = [int(logits[0, -1].argmax())]
    next_position = prompt.shape[1]
    for step in range(new_tokens - 1):
        start_pos = next_position + step if FIXED else next_position
        logits, past = model(torch.tensor([[tokens[-1]]]), start_pos, past)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens, logits[0, -1]


model = Decoder().eval()
prompt = torch.randint(0, VOCAB, (1, 6))
tokens, last = greedy(model, prompt, 5)
print("generated:", tokens)
print("last logits:", [round(x, 4) for x in last[:5].tolist()])
