"""A ClipCap-style captioner: an image's CLIP features projected into `prefix_embeds` (P positions) are fused in
front of the caption tokens inside the model's forward, and a key/value cache object keeps them for the later
steps. The generation loop creates the cache before its first step and hands the prefix only `if cache is None`:
the cache always exists, so the prefix is never handed, the first step included, and no caption token ever attends
the image (python FILE; --fixed: the prefix handed while the cache is still empty).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
CFG = {"vocab": 50, "dim": 32, "heads": 4, "layers": 2, "prefix_length": 6, "clip_dim": 24, "bos": 1}


class KVCache:
    def __init__(self, layers):
        self.keys, self.values = [None] * layers, [None] * layers

    @property
    def length(self):
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer, k, v):
        if self.keys[layer] is not None:
            k, v = torch.cat([self.keys[layer], k], 2), torch.cat([self.values[layer], v], 2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Block(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer, self.heads = layer, CFG["heads"]
        self.qkv = nn.Linear(CFG["dim"], 3 * CFG["dim"])
        self.proj = nn.Linear(CFG["dim"], CFG["dim"])

    def forward(self, x, cache):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        k, v = cache.append(self.layer, k, v)
        total = k.shape[2]
        keep = torch.ones(n, total, dtype=torch.bool).tril(total - n)  # (the new tokens after the cached ones)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.proj(y.transpose(1, 2).reshape(b, n, d))


class PrefixCaptioner(nn.Module):
    def __init__(self):
        super().__init__()
        self.clip_project = nn.Linear(CFG["clip_dim"], CFG["prefix_length"] * CFG["dim"])
        self.wte = nn.Embedding(CFG["vocab"], CFG["dim"])
        self.wpe = nn.Embedding(64, CFG["dim"])
        self.blocks = nn.ModuleList(Block(i) for i in range(CFG["layers"]))
        self.head = nn.Linear(CFG["dim"], CFG["vocab"])

    def forward(self, input_ids, prefix_embeds=None, cache=None):
        x = self.wte(input_ids)
        if prefix_embeds is not None:
            x = torch.cat([prefix_embeds, x], dim=1)
        x = x + self.wpe(torch.arange(cache.length, cache.length + x.shape[1]))[None]
        for block in self.blocks:
            x = block(x, cache)
        return self.head(x[:, -1])


@torch.no_grad()
def caption(model, clip_features, steps=6):
    prefix_embeds = model.clip_project(clip_features).view(clip_features.shape[0], CFG["prefix_length"], CFG["dim"])
    cache = KVCache(CFG["layers"])  # (made up front, as the loop's helpers expect one)
    ids = torch.full((clip_features.shape[0], 1), CFG["bos"])
    for _ in range(steps):
        first = cache.length == 0 if FIXED else cache is None
        logits = model(ids[:, -1:], prefix_embeds=prefix_embeds if first else None, cache=cache)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


def main():
    torch.manual_seed(0)
    model = PrefixCaptioner().eval()
    print("captions", caption(model, torch.randn(2, CFG["clip_dim"])).tolist())


if __name__ == "__main__":
    main()
