# A resampler-style cross-attention (a batch of 3 samples, 4 latent queries each, over each sample's own 5 context
# tokens) that folds the batch into one sequence for a single explicit-softmax call (queries (1, 12), keys (1, 15))
# and applies no block mask: each sample's latents read every sample's context. Fixed: a torch.block_diag mask keeps
# each sample's latents on its own context.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class FoldedCrossAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, latents, context):
        b, n, d = latents.shape
        m = context.shape[1]
        q = self.to_q(latents).reshape(1, b * n, self.heads, self.head_dim).transpose(1, 2)
        k, v = (t.reshape(1, b * m, self.heads, self.head_dim).transpose(1, 2) for t in self.to_kv(context).chunk(2, -1))
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * self.head_dim ** -0.5
        if FIXED:
            own = torch.block_diag(*[torch.ones(n, m, dtype=torch.bool)] * b)
            scores = scores.masked_fill(~own, float("-inf"))
        out = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class Resampler(nn.Module):
    def __init__(self, dim=16, latents=4, depth=2):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(latents, dim))
        self.layers = nn.ModuleList(FoldedCrossAttention(dim) for _ in range(depth))

    def forward(self, context):
        x = self.latents.expand(context.shape[0], -1, -1)
        for layer in self.layers:
            x = x + layer(x, context)
        return x


model = Resampler().eval()
context = torch.randn(3, 5, 16)
with torch.no_grad():
    batched = model(context)[0]
    alone = model(context[:1])[0]
print(f"fixed={FIXED} sample 0 batched vs alone: {(batched - alone).abs().max().item():.3e}")
