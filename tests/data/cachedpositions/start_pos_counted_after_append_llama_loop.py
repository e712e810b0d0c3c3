"""A Meta-llama-style decoder (`forward(tokens, start_pos)`, rotary queries and keys at start_pos + arange, a KV cache
kept per layer that each call's keys are appended to) driven by a greedy loop over a batch of two prompts. The
buggy loop appends each new token to the sequence and then hands `start_pos=len(sequence)`, one past the new token's
own place: the first step after the prompt is rotated at position 9 over keys cached at 0..7, position 8 skipped,
and each step after it one on too. The fix hands `len(sequence) - 1`, the new token's place."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
DIM, HEADS, LAYERS, VOCAB = 32, 4, 2, 40


def rotate(x, start, theta=10000.0):
    half = x.shape[-1] // 2
    positions = torch.arange(start, start + x.shape[2], dtype=torch.float32)
    angles = positions[:, None] * theta ** (-torch.arange(half, dtype=torch.float32) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.cache_k = self.cache_v = None

    def forward(self, x, start_pos):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, start_pos), rotate(k, start_pos)
        if start_pos == 0:
            self.cache_k, self.cache_v = k, v
        else:
            self.cache_k, self.cache_v = torch.cat([self.cache_k, k], 2), torch.cat([self.cache_v, v], 2)
        keys, values = self.cache_k, self.cache_v
        mask = torch.ones(t, keys.shape[2], dtype=torch.bool).tril(keys.shape[2] - t)  # every cached key, then causal
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, t, DIM))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Attention() for _ in range(LAYERS))
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, start_pos):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h, start_pos)
        return self.out(h)


torch.manual_seed(0)
prompts = torch.randint(1, VOCAB, (2, 8))
model = Llama().eval()
sequence = prompts
with torch.no_grad():
    logits = model(sequence, 0)
    for _ in range(4):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
        start = sequence.shape[1] - 1 if FIXED else sequence.shape[1]
        logits = model(next_token, start)
    uncached = Llama().eval()
    uncached.load_state_dict(model.state_dict())
    whole = uncached(sequence, 0)[:, -1]
print("generated:", sequence[:, 8:].tolist())
print("last step matches an uncached pass:", torch.allclose(whole, logits[:, -1], atol=1e-5))
