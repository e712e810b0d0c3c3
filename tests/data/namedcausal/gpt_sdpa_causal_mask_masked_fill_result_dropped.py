# A small GPT run on a right-padded batch through SDPA; the caller builds `causal_mask` (1, 1, L, L) and the model adds
# its padding bias to it. Buggy: `mask.masked_fill(...)` is not in place and its result is dropped, so the causal mask
# handed in is all zeros and every real token sees the later ones. Fixed: the result is kept.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
V, D, H, L = 50, 16, 2, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.ln = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, x, bias):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, D))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(L, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, attention_mask, causal_mask):
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(t))
        padding = torch.zeros(attention_mask.shape, dtype=x.dtype).masked_fill(attention_mask == 0, float("-inf"))
        bias = causal_mask + padding[:, None, None, :]
        for block in self.blocks:
            x = block(x, bias)
        return self.head(x)


def make_causal_mask(length):
    mask = torch.zeros(1, 1, length, length)
    upper = torch.ones(length, length, dtype=torch.bool).triu(1)
    if FIXED:
        mask = mask.masked_fill(upper, float("-inf"))
    else:
        mask.masked_fill(upper, float("-inf"))  # (not in place: the result is dropped)
    return mask


model = TinyGPT().eval()
input_ids = torch.randint(1, V, (2, L))
attention_mask = torch.ones(2, L, dtype=torch.long)
attention_mask[1, 4:] = 0
input_ids[1, 4:] = 0
with torch.no_grad():
    logits = model(input_ids, attention_mask, make_causal_mask(L))
print("fixed" if FIXED else "buggy", logits[0, 0, :3].tolist())
