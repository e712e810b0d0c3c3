"""mlxcel batched (B>1) MTP speculative verify: a row's rejected draft tail stays visible.

lablup/mlxcel#163 ("per-row valid-length tail not masked on verify"), fixed by PR #202 (Rust;
torch port written from the issue text). In a batched burst every row's verify window is written
at the shared physical cache offset; after a mixed-accept round the cache is rolled back to the
batch's max accept, so a row that accepted fewer drafts keeps its rejected draft K/V in
[valid_end_r, offset). The verify mask was causal over physical positions only, so that row's
next verify attends its own rejected drafts. Fix: per-row valid-length mask excludes the stale tail.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class KVCache:
    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys[:, :, : self.offset], k], dim=2)
            self.values = torch.cat([self.values[:, :, : self.offset], v], dim=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def trim(self, n):
        self.offset -= n


def create_causal_mask(n, offset, valid_end=None):
    # (B or 1, n, offset + n) boolean, True = attend
    rinds = torch.arange(offset + n)
    linds = torch.arange(offset, offset + n)
    mask = linds[:, None] >= rinds[None]
    mask = mask[None]
    if valid_end is not None:
        stale = (rinds[None] >= valid_end[:, None]) & (rinds[None] < offset)
        mask = mask & ~stale[:, None, :]
    return mask


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask, cache):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        k, v = cache.update_and_fetch(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o(out.transpose(1, 2).reshape(B, L, D))


class Model(nn.Module):
    def __init__(self, vocab=50, dim=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, caches, valid_end=None):
        h = self.emb(tokens)
        mask = create_causal_mask(tokens.shape[1], caches[0].offset, valid_end)
        for layer, c in zip(self.layers, caches):
            h = h + layer(h, mask, c)
        return self.head(h)


def main():
    model = Model().eval()
    prompt = torch.randint(0, 50, (2, 6))
    drafts1 = torch.randint(0, 50, (2, 3))
    drafts2 = torch.randint(0, 50, (2, 3))
    accepts = [3, 1]  # divergent round: row 0 takes all drafts, row 1 only the first
    with torch.no_grad():
        caches = [KVCache() for _ in model.layers]
        model(prompt, caches)
        model(drafts1, caches)  # verify window 1 at the shared offset
        valid_end = torch.tensor([prompt.shape[1] + a for a in accepts])
        for c in caches:  # roll back to the batch's max accept
            c.trim(drafts1.shape[1] - max(accepts))
        logits = model(drafts2, caches, valid_end if FIXED else None)  # verify window 2

        # row 1 on its own (B=1): cache holds exactly prompt + accepted drafts
        solo = [KVCache() for _ in model.layers]
        model(torch.cat([prompt[1:], drafts1[1:, : accepts[1]]], 1), solo)
        ref = model(drafts2[1:], solo)
    print(f"row 1 verify logits vs B=1 run, max |diff| = {(logits[1] - ref[0]).abs().max():.4f}")


if __name__ == "__main__":
    main()
