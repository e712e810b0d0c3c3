# Written after sramshetty/mixture-of-depths#5 (485e14d), another way: a Mixture-of-Depths decoder block over a
# right-padded batch routes its top-capacity tokens with torch.topk (sorted by router score, not by position), gathers
# them with torch.gather and runs SDPA with a causal mask over the routed order, so a routed token sees routed tokens
# that come after it in the sequence. Padding is never routed (its score is -inf) and masked as keys.
# --fixed sorts the routed positions before the gather.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)


class RoutedBlock(nn.Module):
    def __init__(self, dim, heads, capacity):
        super().__init__()
        self.heads, self.capacity = heads, capacity
        self.router = nn.Linear(dim, 1)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden, attention_mask):  # attention_mask: (B, L), 1 = real token
        b, n, d = hidden.shape
        logits = self.router(hidden).squeeze(-1).masked_fill(attention_mask == 0, float("-inf"))
        weight, chosen = torch.topk(logits, self.capacity, dim=1)          # best first
        if FIXED:
            chosen, order = chosen.sort(dim=1)
            weight = weight.gather(1, order)
        routed = torch.gather(hidden, 1, chosen.unsqueeze(-1).expand(-1, -1, d))
        keys_real = torch.gather(attention_mask, 1, chosen).bool()
        causal = torch.ones(self.capacity, self.capacity, dtype=torch.bool).tril()
        allowed = causal[None, None] & keys_real[:, None, None, :]
        q, k, v = (t.view(b, self.capacity, self.heads, -1).transpose(1, 2) for t in self.qkv(routed).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = self.proj(out.transpose(1, 2).reshape(b, self.capacity, d)) * torch.sigmoid(weight)[..., None]
        return hidden.scatter_add(1, chosen.unsqueeze(-1).expand(-1, -1, d), out)


B, L, D = 2, 12, 16
lengths = torch.tensor([12, 9])
attention_mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
block = RoutedBlock(D, heads=2, capacity=6).eval()
hidden = torch.randn(B, L, D, requires_grad=True)
out = block(hidden, attention_mask)
leak = 0.0
for p in range(L - 1):
    g, = torch.autograd.grad(out[:, p].pow(2).sum(), hidden, retain_graph=True)
    leak = max(leak, g[:, p + 1:].abs().max().item())
print(f"max |d out[p] / d hidden[q>p]| (future leak): {leak:.3e}")
