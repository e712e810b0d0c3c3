"""Set Transformer ISAB: 6 induced points read a padded set, then every set element reads them back.

Follows lucidrains/isab-pytorch isab_pytorch/isab_pytorch.py (Attention with `mask` filled with
-finfo.max, ISAB.forward: `induced = attn1(queries, x, mask=mask)`, `out = attn2(x, induced)`).
Point clouds of different sizes are right-padded to n=15 with a bool mask (True = real point).
Step 1: the learned induced points (6 queries, fewer than the 15 keys) attend over the set with the
padding hidden, so padding cannot leak into the summary. Step 2: every set element (pads included)
attends to the 6 induced points with no mask: the induced points are all valid, and pad rows are
discarded by the masked mean pool at the end.
Mask meant: attn1 rows see exactly the real points of their set; attn2 is unmasked (15 x 6).
"""
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        assert (dim % heads) == 0, "dimension must be divisible by number of heads"
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, dim * 2, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, context, mask=None):
        h = self.heads
        b = x.shape[0]
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        if mask is not None:
            mask_value = -torch.finfo(dots.dtype).max
            dots.masked_fill_(~mask[:, None, None, :], mask_value)
        attn = dots.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, -1, h * out.shape[-1]))


class ISAB(nn.Module):
    def __init__(self, *, dim, heads=4, num_induced_points=None):
        super().__init__()
        self.induced_points = nn.Parameter(torch.randn(num_induced_points, dim)) if num_induced_points else None
        self.attn1 = Attention(dim, heads)
        self.attn2 = Attention(dim, heads)

    def forward(self, x, queries=None, mask=None):
        b = x.shape[0]
        assert (queries is not None) ^ (self.induced_points is not None), \
            "you can only either learn the induced points within the module, or pass it in externally"
        queries = queries if queries is not None else self.induced_points
        if queries.ndim == 2:
            queries = queries.unsqueeze(0).expand(b, -1, -1)
        induced = self.attn1(queries, x, mask=mask)
        out = self.attn2(x, induced)
        return out, induced


class SetEncoder(nn.Module):
    def __init__(self, in_dim=3, dim=32, depth=2, num_induced_points=6):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList([ISAB(dim=dim, num_induced_points=num_induced_points) for _ in range(depth)])

    def forward(self, points, mask):
        x = self.embed(points)
        for block in self.blocks:
            out, _ = block(x, mask=mask)
            x = x + out
        # masked mean pool: pad rows never reach the set embedding
        m = mask.unsqueeze(-1).float()
        return (x * m).sum(1) / m.sum(1)


if __name__ == "__main__":
    torch.manual_seed(0)
    lengths = torch.tensor([15, 9, 4])
    n = int(lengths.max())
    points = torch.randn(len(lengths), n, 3)
    mask = torch.arange(n)[None, :] < lengths[:, None]
    points = points.masked_fill(~mask[..., None], 0.0)
    encoder = SetEncoder().eval()
    with torch.no_grad():
        emb = encoder(points, mask)
    print("set embeddings", tuple(emb.shape))
