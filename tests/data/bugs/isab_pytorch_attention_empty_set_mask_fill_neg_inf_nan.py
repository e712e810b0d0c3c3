# isab-pytorch (lucidrains/isab-pytorch commit 9968cf7, "replace float -inf for stability"): Attention in the ISAB
# filled masked set elements with float('-inf'), so a set whose elements are all padding gets a fully -inf row for
# every induced point, softmax gives NaN, and the NaN reaches the gradients of the whole padded batch.
import sys

import torch
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


# einops is not available here: these two helpers do exactly what the upstream rearrange/repeat calls do
def split_heads(t, h):  # rearrange(t, 'b n (h d) -> b h n d', h = h)
    b, n, hd = t.shape
    return t.reshape(b, n, h, hd // h).permute(0, 2, 1, 3)


def merge_heads(t):  # rearrange(out, 'b h n d -> b n (h d)')
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)


class Attention(nn.Module):
    def __init__(self, dim, heads = 8):
        super().__init__()
        assert (dim % heads) == 0, 'dimension must be divisible by number of heads'
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.to_q = nn.Linear(dim, dim, bias = False)
        self.to_kv = nn.Linear(dim, dim * 2, bias = False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, context, mask = None):
        h, scale = self.heads, self.scale

        q = self.to_q(x)
        kv = self.to_kv(context).chunk(2, dim = -1)

        q, k, v = map(lambda t: split_heads(t, h), (q, *kv))
        dots = einsum('b h i d, b h j d -> b h i j', q, k) * scale

        if exists(mask):
            mask = mask[:, None, None, :]  # rearrange(mask, 'b n -> b () () n')
            if FIXED:
                mask_value = -torch.finfo(dots.dtype).max
                dots.masked_fill_(~mask, mask_value)
            else:
                dots.masked_fill_(~mask, float('-inf'))

        attn = dots.softmax(dim = -1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)

        out = merge_heads(out)
        return self.to_out(out)


class ISAB(nn.Module):
    def __init__(self, *, dim, heads = 8, num_induced_points = None):
        super().__init__()
        self.induced_points = nn.Parameter(torch.randn(num_induced_points, dim)) if exists(num_induced_points) else None
        self.attn1 = Attention(dim, heads)
        self.attn2 = Attention(dim, heads)

    def forward(self, x, queries = None, mask = None):
        b, *_ = x.shape
        assert exists(queries) ^ exists(self.induced_points), 'you can only either learn the induced points within the module, or pass it in externally'
        queries = queries if exists(queries) else self.induced_points

        if queries.ndim == 2:
            queries = queries.unsqueeze(0).expand(b, -1, -1)  # repeat(queries, 'n d -> b n d', b = b)

        induced = self.attn1(queries, x, mask = mask)
        out     = self.attn2(x, induced)
        return out, induced


dim, heads, m = 32, 4, 6
attn = ISAB(dim = dim, heads = heads, num_induced_points = m)
head = nn.Linear(dim, 1)

# a padded batch of three sets; the last one has no elements at all (e.g. an empty context set)
lengths = [9, 5, 0]
n = max(lengths)
x = torch.randn(len(lengths), n, dim)
mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
x = x * mask[..., None]
target = torch.randn(len(lengths), n, 1)

out, induced = attn(x, mask = mask)
pred = head(out)
loss = ((pred - target) ** 2)[mask].mean()  # the loss only reads real set elements
loss.backward()

grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in list(attn.parameters()) + list(head.parameters())))
print(f"NaN entries in induced points of the empty set: {int(torch.isnan(induced[2]).sum())}")
print(f"loss over real elements: {loss.item():.6f}")
print(f"gradient norm of the training step: {grad_norm.item():.6f}")

# the non-empty sets alone, unpadded: same output as in the batch (masking of real padding is fine both ways)
with torch.no_grad():
    diffs = []
    for i, L in enumerate(lengths[:2]):
        alone, _ = attn(x[i:i + 1, :L], mask = torch.ones(1, L, dtype = torch.bool))
        diffs.append((out[i, :L] - alone[0]).abs().max().item())
print(f"max diff non-empty sets batched vs alone: {max(diffs):.3e}")
