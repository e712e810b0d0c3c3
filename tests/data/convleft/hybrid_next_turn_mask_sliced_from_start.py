# The bug of huggingface/transformers#47087 (the padding mask of the recurrent layers lost on a continued forward)
# written another way: a hybrid chat model whose second turn runs on top of its cache, left-padded because the replies
# differ in length. The recurrent layers' mask is cut from the full (B, past + T) attention_mask; the bug takes its
# first T columns (the first turn's, all ones) instead of its last T, so the second turn's padding keeps its states,
# and the causal conv over [cached conv state, new states] (nn.Conv1d without padding) carries them into the first
# real tokens after it. The attention layers use a boolean SDPA mask over the cached keys.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(7)

D, HEADS, K, VOCAB, PAD = 16, 2, 4, 40, 1
KINDS = ("conv", "attn", "conv")


class Cache:
    def __init__(self):
        self.kv, self.conv = {}, {}

    def past(self):
        return next(iter(self.kv.values()))[0].shape[2] if self.kv else 0


class ConvMixer(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i
        self.inp = nn.Linear(D, 2 * D, bias=False)
        self.conv = nn.Conv1d(D, D, K, groups=D)
        self.out = nn.Linear(D, D, bias=False)

    def forward(self, h, cache, mask):
        x, gate = self.inp(h).chunk(2, -1)
        if mask is not None:
            x = x * mask[:, :, None]
        x = x.transpose(1, 2)
        state = cache.conv.get(self.i, x.new_zeros(x.shape[0], D, K - 1))
        full = torch.cat([state, x], -1)
        cache.conv[self.i] = full[..., -(K - 1):]
        y = F.silu(self.conv(full)).transpose(1, 2)
        if mask is not None:
            y = y * mask[:, :, None]
        return self.out(y * torch.sigmoid(gate))


class Attn(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.out = nn.Linear(D, D, bias=False)

    def forward(self, h, cache, mask):
        b, t, _ = h.shape
        q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in self.qkv(h).chunk(3, -1))
        if self.i in cache.kv:
            k = torch.cat([cache.kv[self.i][0], k], 2)
            v = torch.cat([cache.kv[self.i][1], v], 2)
        cache.kv[self.i] = (k, v)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, t, D))


class HybridLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in KINDS)
        self.mixers = nn.ModuleList(Attn(i) if kind == "attn" else ConvMixer(i) for i, kind in enumerate(KINDS))

    def forward(self, input_ids, attention_mask, cache):
        t, past = input_ids.shape[1], cache.past()
        positions = torch.arange(past, past + t)
        causal = torch.arange(past + t)[None, :] <= positions[:, None]
        attn_mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        segment = attention_mask[:, -t:] if FIXED else attention_mask[:, :t]
        conv_mask = None if bool(segment.all()) else segment.to(torch.float32)
        h = self.emb(input_ids)
        for kind, norm, mixer in zip(KINDS, self.norms, self.mixers):
            h = h + mixer(norm(h), cache, attn_mask if kind == "attn" else conv_mask)
        return h


model = HybridLM().eval()
turn1 = torch.tensor([[3, 9, 14, 21, 6], [3, 9, 14, 21, 6]])
replies = [[12, 30, 7, 19, 25, 8], [33, 5]]
width = max(map(len, replies))
turn2 = torch.tensor([[PAD] * (width - len(r)) + r for r in replies])
mask2 = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in replies])
full_mask = torch.cat([torch.ones_like(turn1), mask2], 1)

with torch.no_grad():
    whole = model(torch.cat([turn1, turn2], 1), full_mask, Cache())
    cache = Cache()
    model(turn1, torch.ones_like(turn1), cache)
    second = model(turn2, full_mask, cache)
real = mask2.bool()
diff = (second - whole[:, turn1.shape[1]:]).abs().amax(-1)[real].max().item()
print(f"max |second turn on the cache - one forward| on real tokens: {diff:.3e}")
