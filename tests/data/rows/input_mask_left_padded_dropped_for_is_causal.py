"""A decoder whose forward takes `tokens` and a plain `input_mask` (1 = a token) and hands SDPA `is_causal=True`
alone, the mask never reaching the attention: on a left-padded batch (pad id 2, no `padding_idx` on the embedding,
no config) each real token attends to the padding before it. `--fixed` folds the mask into a bool attn_mask with the
causal one (each padding query kept on itself, as Hugging Face does, so no row is empty). Written as a second form of
x-transformers d69d33c (a left-padded batch's plain `mask` dropped), differently: SDPA, the mask the ids' own length,
no wrapper."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h, attn_mask=None):
        b, n, d = h.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class TinyLM(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList(Layer(d) for _ in range(2))

    def forward(self, tokens, input_mask=None):
        n = tokens.shape[1]
        attn_mask = None
        if FIXED and input_mask is not None:
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            attn_mask = (causal[None] & input_mask.bool()[:, None, :]) | torch.eye(n, dtype=torch.bool)[None]
            attn_mask = attn_mask[:, None]
        h = self.emb(tokens)
        for layer in self.layers:
            h = h + layer(h, attn_mask)
        return self.out(h)


torch.manual_seed(0)
PAD = 2
rows = [[5, 9, 14, 7, 21, 11], [30, 6, 4], [8, 19, 25, 17]]
tokens = torch.full((3, 6), PAD)
for i, row in enumerate(rows):
    tokens[i, 6 - len(row):] = torch.tensor(row)
input_mask = (tokens != PAD).long()
model = TinyLM()
logits = model(tokens, input_mask=input_mask)
loss = F.cross_entropy(logits[:, :-1].reshape(-1, 32), tokens[:, 1:].reshape(-1), reduction="none")
loss = (loss * input_mask[:, 1:].reshape(-1)).sum() / input_mask[:, 1:].sum()
loss.backward()
print("fixed" if FIXED else "buggy", round(loss.item(), 4))
