# Written after PrunaAI/pruna#537 (573dc33), another way: a BERT-style text encoder over a right-padded batch, einsum
# scores, the padding as an additive -10000 bias, and a per-layer head mask (num_layers, heads) viewed as (heads, 1, 1)
# and added to the scores beside the padding bias: the softmax cancels a per-head constant, so the heads it prunes
# attend as before. --fixed multiplies the attention probabilities by the head mask after the softmax (HF's semantics).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(2)


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden, pad_bias, layer_head_mask):
        b, n, d = hidden.shape
        q, k, v = (proj(hidden).view(b, n, self.heads, -1) for proj in (self.query, self.key, self.value))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5
        scores = scores + pad_bias
        gate = layer_head_mask.view(self.heads, 1, 1)
        if not FIXED:
            scores = scores + gate
        probs = scores.softmax(dim=-1)
        if FIXED:
            probs = probs * gate
        return torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, d)


class Encoder(nn.Module):
    def __init__(self, dim=16, heads=4, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(SelfAttention(dim, heads) for _ in range(layers))

    def forward(self, hidden, attention_mask, head_mask):
        pad_bias = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        for layer, layer_head_mask in zip(self.layers, head_mask):
            hidden = hidden + layer(hidden, pad_bias, layer_head_mask)
        return hidden


lengths = torch.tensor([7, 5, 3])
attention_mask = (torch.arange(7)[None, :] < lengths[:, None]).long()
head_mask = torch.ones(2, 4)
head_mask[0, 2] = 0.0  # prune head 2 of layer 0
head_mask[1, 0] = 0.0  # and head 0 of layer 1
model = Encoder().eval()
x = torch.randn(3, 7, 16)
with torch.no_grad():
    pruned = model(x, attention_mask, head_mask)
    whole = model(x, attention_mask, torch.ones(2, 4))
print(f"max |output(heads pruned) - output(no head pruned)|: {(pruned - whole).abs().max().item():.3e}")
