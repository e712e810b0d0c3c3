"""A decoder layer whose forward builds its causal mask only in the branch for no cache: a prompt run through the cache
attends both ways (the slip of alpa-projects/alpa#608, written another way).

The layer keeps a growing cache (`torch.cat` of past and new keys, handed in as `layer_past`) and calls SDPA with a
bool mask. Without a cache it builds `torch.tril(ones(L, L))`; with one it only hides the batch's padding keys (the
caller's `key_mask`), which is all a decode step of one token needs. A serving loop that starts every request with an
empty cache tuple, so that the prompt goes through the cached branch too, lets each prompt token see the later ones.
--fixed builds the causal part in the cached branch as well, placed after the past keys. Prints the greedy tokens and
the largest gap between the prompt's last logits and an uncached run of the same prompt (0 with --fixed).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

DIM, HEADS, VOCAB = 32, 4, 50


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, key_mask, layer_past=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        if layer_past is None:
            allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None] & key_mask[:, None, None, :]
        else:
            if len(layer_past):
                k, v = torch.cat([layer_past[0], k], dim=2), torch.cat([layer_past[1], v], dim=2)
            total = k.shape[2]
            allowed = key_mask[:, None, None, :total].expand(b, 1, n, total)
            if FIXED:
                rows = torch.arange(total - n, total)[:, None]
                allowed = allowed & (torch.arange(total)[None, :] <= rows)[None, None]
            layer_past = (k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.out(y.transpose(1, 2).reshape(b, n, DIM))
        return x + self.ff(x), layer_past


class TinyLM(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(64, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, start, key_mask, past=None):
        x = self.embed(ids) + self.pos(torch.arange(start, start + ids.shape[1]))[None]
        new = []
        for i, layer in enumerate(self.layers):
            x, kept = layer(x, key_mask, None if past is None else past[i])
            new.append(kept)
        return self.head(x), (None if past is None else new)


model = TinyLM().eval()
prompt = torch.tensor([[7, 3, 19, 4, 22, 11, 5]])
with torch.no_grad():
    reference, _ = model(prompt, 0, torch.ones(1, prompt.shape[1], dtype=torch.bool))
    key_mask = torch.ones(1, prompt.shape[1] + 5, dtype=torch.bool)
    logits, past = model(prompt, 0, key_mask, past=[() for _ in model.layers])  # every request: an empty cache
    gap = float((logits[0, -1] - reference[0, -1]).abs().max())
    tokens, at = [], prompt.shape[1]
    token = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(4):
        tokens.append(int(token))
        logits, past = model(token, at, key_mask, past=past)
        token, at = logits[:, -1].argmax(-1, keepdim=True), at + 1
print("greedy:", tokens)
print(f"prompt's last logits against an uncached run: largest gap {gap:.2e}")
