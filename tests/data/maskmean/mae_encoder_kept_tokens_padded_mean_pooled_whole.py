"""An MAE-style encoder that drops each sample's masked patches, pads the kept ones to the longest, and mean-pools.

Each sample keeps its visible patches (a different number per sample: cloud cover), moved to the front and padded to
the batch's longest with zeros; the padding exists only inside the model, where the attention hides it from every
query (`key_padding_mask`). The embedding is `x.mean(dim=1)` over every slot, the padded tail included, so a sample's
embedding changes with how many patches the others kept. --fixed averages over the kept slots only.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, H = 16, 2


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.layers = nn.ModuleList(nn.MultiheadAttention(D, H, batch_first=True) for _ in range(2))

    def forward(self, patches, visible):
        kept = [p[v] for p, v in zip(patches, visible)]
        width = max(len(k) for k in kept)
        x = torch.zeros(len(kept), width, D)
        dropped = torch.ones(len(kept), width, dtype=torch.bool)  # (True = a padded slot)
        for b, k in enumerate(kept):
            x[b, :len(k)] = self.embed(k)
            dropped[b, :len(k)] = False
        for attention in self.layers:
            x = x + attention(x, x, x, key_padding_mask=dropped, need_weights=False)[0]
        if FIXED:
            return (x * ~dropped[..., None]).sum(1) / (~dropped).sum(1, keepdim=True)
        return x.mean(dim=1)


model = Encoder().eval()
patches = torch.randn(3, 10, 8)
visible = torch.rand(3, 10) > torch.tensor([[0.2], [0.6], [0.4]])
visible[0] = True  # (one sample unclouded: nothing dropped)
with torch.no_grad():
    print("embeddings[:, :3]:", model(patches, visible)[:, :3].tolist())
