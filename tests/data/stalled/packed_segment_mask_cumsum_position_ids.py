# hiyouga/LlamaFactory#7754 written another way: an OpenRLHF-style packed actor batch whose attention_mask holds each
# sample's number (1, 2, 3 .., 0 = padding, right-padded) and whose position_ids were made by the unpacked path's
# `attention_mask.cumsum(-1) - 1`, so the n-th sample's positions count by n; the fix restarts them per sample
# (OpenRLHF's reset_position_ids). 1-D rotary ids, an eager softmax over the samples' causal blocks.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(2)


def reset_position_ids(attention_mask):
    position_ids = torch.zeros_like(attention_mask, dtype=torch.long)
    for i in range(attention_mask.size(0)):
        mask = attention_mask[i]
        for index in range(1, int(mask.max()) + 1):
            sample = mask == index
            position_ids[i, sample] = torch.arange(int(sample.sum()))
    return position_ids


def rope(x, positions, base=10000.0):
    half = x.shape[-1] // 2
    freqs = positions[:, None, :, None].float() / base ** (torch.arange(half).float() / half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * freqs.cos() - x2 * freqs.sin(), x1 * freqs.sin() + x2 * freqs.cos()), dim=-1)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, keep, positions):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rope(q, positions), rope(k, positions)
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        weights = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
        return x + self.proj((weights @ v).transpose(1, 2).reshape(b, n, d))


class PackedActor(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))

    def forward(self, input_ids, attention_mask, position_ids):
        n = input_ids.shape[1]
        same = attention_mask[:, :, None] == attention_mask[:, None, :]
        keep = same & torch.ones(n, n, dtype=torch.bool).tril() & (attention_mask != 0)[:, None, :]
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, keep[:, None], position_ids)
        return h


samples = [[6, 5, 4], [3, 7]]
L = 16
input_ids = torch.zeros(len(samples), L, dtype=torch.long)
attention_mask = torch.zeros(len(samples), L, dtype=torch.long)
for row, lens in enumerate(samples):
    start = 0
    for index, n in enumerate(lens, 1):
        input_ids[row, start:start + n] = torch.randint(1, 40, (n,))
        attention_mask[row, start:start + n] = index
        start += n
if FIXED:
    position_ids = reset_position_ids(attention_mask)
else:
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
actor = PackedActor().eval()
with torch.no_grad():
    packed = actor(input_ids, attention_mask, position_ids)
    gap, start = 0.0, 0
    for row, lens in enumerate(samples):
        start = 0
        for n in lens:
            ids = input_ids[row:row + 1, start:start + n]
            alone = actor(ids, torch.ones(1, n, dtype=torch.long), torch.arange(n)[None])
            gap = max(gap, (packed[row, start:start + n] - alone[0]).abs().max().item())
            start += n
print("max |packed sample - the sample alone|:", f"{gap:.6f}")
