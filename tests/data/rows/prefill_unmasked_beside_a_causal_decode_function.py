"""A decoder whose layer attends its decode steps through a method named causal (`_decode_causal`) and its prompt
through another, handed the generator's mask, None: the buggy prompt pass runs unmasked (both ways) and the cache is
written from it; `--fixed` builds the causal mask when none is handed. Written as a second form of lablup/mlxcel#999,
differently: a batch of two, the kernels as methods of the layer, a 5-token prompt, is_causal for the fix."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.k = self.v = None

    def _prompt(self, q, k, v, mask):
        if mask is None and FIXED:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _decode_causal(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)  # (one query: every cached key is earlier)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        out = self._prompt(q, k, v, mask) if n > 1 else self._decode_causal(q, self.k, self.v)
        return self.out(out.transpose(1, 2).reshape(b, n, d))


class Decoder(nn.Module):
    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList(Layer(d) for _ in range(2))

    def forward(self, tokens, mask=None):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h, mask)
        return self.head(h)


torch.manual_seed(0)
model = Decoder().eval()
tokens = torch.tensor([[3, 9, 12, 4, 20], [7, 7, 1, 30, 2]])
with torch.no_grad():
    logits = model(tokens, mask=None)
    for _ in range(2):
        logits = model(logits[:, -1:].argmax(-1), mask=None)
print("fixed" if FIXED else "buggy")
