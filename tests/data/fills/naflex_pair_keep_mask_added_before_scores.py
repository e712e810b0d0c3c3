# The same bug as huggingface/pytorch-image-models PR #2686 (timm's non-fused Attention adding the caller's bool
# keep-mask to the scores), written another way: a NaFlex-style vision tower batches images of different patch counts,
# builds a (B, N, N) bool pair mask (both patches real) for its eager path and adds it in front of the scores
# (`mask + scores`): True and False count as 1 and 0, so padding patches stay attended. The fused path, which the fix
# also takes, turns the keep mask into a 0 / -inf bias first.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def pair_bias(patch_valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, N, N) bool: query and key both real patches (the fix: a 0 / -inf bias of it)."""
    keep = (patch_valid[:, :, None] & patch_valid[:, None, :])[:, None]
    if FIXED:
        keep = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
        keep = keep.masked_fill(~patch_valid[:, None, :, None], 0.0)  # padded query rows: left whole, never read
    return keep


class Block(nn.Module):
    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(dim)
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, bias):
        b, n, d = x.shape
        h = self.norm(x)
        q, k, v = (f(h).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = bias + q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5
        return x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class Tower(nn.Module):
    def __init__(self, patch=4, dim=24, depth=2):
        super().__init__()
        self.patch, self.embed = patch, nn.Linear(3 * patch * patch, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, patches, patch_valid):
        x = self.embed(patches)
        bias = pair_bias(patch_valid, x.dtype)
        for block in self.blocks:
            x = block(x, bias)
        valid = patch_valid[..., None].float()
        return (x * valid).sum(1) / valid.sum(1)


counts = (6, 4, 3)  # patches of each image; the batch padded to 6
patches = torch.randn(3, 6, 48)
patch_valid = torch.arange(6)[None, :] < torch.tensor(counts)[:, None]
model = Tower().eval()
with torch.no_grad():
    batched = model(patches, patch_valid)
    alone = torch.cat([model(patches[i:i + 1, :c], patch_valid[i:i + 1, :c]) for i, c in enumerate(counts)])
print("max |batched - alone|:", float((batched - alone).abs().max()))
