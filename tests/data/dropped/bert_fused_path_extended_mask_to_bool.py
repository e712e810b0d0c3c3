# A BERT-style encoder over a right-padded batch: the model makes the extended additive mask (1 - mask) * finfo.min
# as [B, 1, 1, L] and hands it to each layer's `attention(...)`, whose fused path wants a bool mask for SDPA. Buggy:
# `attention_mask.to(torch.bool)` is True where the bias is non-zero, on the padding, and SDPA keeps True: each real
# token attends only the padding. Fixed: `attention_mask == 0`.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, H = 16, 2


def attention(q, k, v, attention_mask):
    keep = attention_mask == 0 if FIXED else attention_mask.to(torch.bool)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.ln = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, x, attention_mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v, attention_mask).transpose(1, 2).reshape(b, t, D)
        return self.ln(x + self.out(y))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, D)
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, input_ids, attention_mask):
        extended = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, extended)
        return x


model = Encoder().eval()
input_ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 0, 0, 0], [11, 12, 13, 14, 0, 0]])
attention_mask = (input_ids != 0).long()
with torch.no_grad():
    out = model(input_ids, attention_mask)
print("fixed" if FIXED else "buggy", out[1, 0, :3].tolist())
