# A Group-DETR-style decoder: 2 groups of object queries trained together must not see each other, so the head builds
# a (Q, Q) bool keep mask (True = may attend, the opposite of nn.MultiheadAttention's) and hands it to every decoder
# layer as `self_attention_mask`; the layer takes the parameter and never passes it to its SDPA self-attention, so
# each group reads the other. Fixed: the layer hands it on as attn_mask.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class DecoderLayer(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.cross = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, tgt, memory, query_pos, self_attention_mask=None):
        B, Q, D = tgt.shape
        q, k, v = self.qkv(tgt + query_pos).view(B, Q, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        keep = self_attention_mask if FIXED else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        tgt = self.norm1(tgt + self.proj(y.transpose(1, 2).reshape(B, Q, D)))
        return self.norm2(tgt + self.cross(tgt + query_pos, memory, memory)[0])


class GroupDecoder(nn.Module):
    def __init__(self, groups=2, per_group=5, d=32, depth=2):
        super().__init__()
        self.groups, self.per_group = groups, per_group
        self.query_embed = nn.Embedding(groups * per_group, d)
        self.query_pos = nn.Embedding(groups * per_group, d)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(depth))

    def forward(self, memory):
        B = memory.shape[0]
        group = torch.arange(self.groups * self.per_group) // self.per_group
        keep = group[:, None] == group[None, :]  # each group sees itself only
        tgt = self.query_embed.weight.expand(B, -1, -1)
        pos = self.query_pos.weight.expand(B, -1, -1)
        for layer in self.layers:
            tgt = layer(tgt, memory, pos, self_attention_mask=keep)
        return tgt


model = GroupDecoder().eval()
memory = torch.randn(2, 12, 32)
with torch.no_grad():
    out = model(memory)
    model.query_embed.weight[5:] += 1.0  # change only group 1's queries
    out2 = model(memory)
print(f"fixed={FIXED} group 0 moved by group 1: {(out2[:, :5] - out[:, :5]).abs().max().item():.3e}")
