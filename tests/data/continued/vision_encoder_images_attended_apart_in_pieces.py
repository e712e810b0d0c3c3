# A vision encoder in the way GLM-4V's eager attention runs one (quiet-r159b): the patches of several images packed
# into one sequence, attended image by image (one softmax per image, at one line), the images' grid handed beside the
# patches. Run once over three images, then over the first image and over the other two apart (a model that keeps
# the last grid it saw: module state assigned between the calls). Each image's patches see their own image's patches
# in every run, so nothing is dropped.
import torch
import torch.nn as nn

torch.manual_seed(0)


class Encoder(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.last_grid = None

    def forward(self, grid, patches):  # grid (images, 2): each image's rows and columns; patches (N, dim)
        self.last_grid = grid.clone()
        q, k, v = self.qkv(patches).chunk(3, -1)
        out, start = [], 0
        for rows, cols in grid.tolist():
            end = start + rows * cols
            weights = torch.softmax(q[None, None, start:end] @ k[None, None, start:end].transpose(-2, -1), dim=-1)
            out.append((weights @ v[None, None, start:end])[0, 0])
            start = end
        return torch.cat(out)


encoder = Encoder().eval()
grid = torch.tensor([[2, 3], [3, 3], [2, 2]])
patches = torch.randn(int((grid[:, 0] * grid[:, 1]).sum()), 8)
with torch.no_grad():
    whole = encoder(grid, patches)
    first = encoder(grid[:1], patches[:6])
    rest = encoder(grid[1:], patches[6:])
print(f"|one pass - apart|: {(whole - torch.cat([first, rest])).abs().max().item():.3e}")
