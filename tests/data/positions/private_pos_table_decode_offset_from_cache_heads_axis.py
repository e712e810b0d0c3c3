"""A decoder keeps its learned position table in a private attribute and reads its decode offset off the wrong axis.

dmlc/gluon-nlp#1015 (tests/data/bugs/gluonnlp_gpt2_decode_positions_from_num_heads.py) written another way: a
hand-written GPT whose private `self._position_embedding` table numbers each token (indexed inline, no local of
positions), a batch of 2 prompts
of one length, SDPA with `is_causal` at the prompt and no mask at each one-token step, a cache per layer stacked as
(2, batch, heads, length, head_dim). The offset of a step is `cache[0].size(2)` (the batch, then the heads axis:
3 heads here) where the fix takes `cache[0].size(3)`, the cached length: every decoded token reads row 3 of the
table.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ln = nn.LayerNorm(dim)

    def forward(self, x, cache):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None and t > 1)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d)), torch.stack([k, v])


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, dim=48, heads=3, layers=2, context=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self._position_embedding = nn.Embedding(context, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, caches=None):
        offset = 0 if caches is None else caches[0].size(3 if FIXED else 2)
        x = self.tok(tokens) + self._position_embedding(torch.arange(offset, offset + tokens.shape[1]))[None]
        new = []
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, None if caches is None else caches[i])
            new.append(cache)
        return self.head(x), new


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    prompts = torch.tensor([[3, 14, 15, 9, 26, 5], [8, 27, 18, 2, 33, 41]])
    logits, caches = model(prompts)
    tokens = [prompts]
    for _ in range(6):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        logits, caches = model(nxt, caches)
    print("generated:", torch.cat(tokens, dim=1)[:, prompts.shape[1]:].tolist())


if __name__ == "__main__":
    main()
