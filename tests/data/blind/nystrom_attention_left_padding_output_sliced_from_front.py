# lucidrains/nystrom-attention commit d7eb229 ("fix padding bug"): NystromAttention left-pads the sequence
# (and its mask with False) to a multiple of num_landmarks, but slices the output with out[:, :n], returning the
# masked padding rows and dropping the last real tokens.
import sys
from math import ceil
import torch
from torch import nn, einsum
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def moore_penrose_iter_pinv(x, iters=6):
    abs_x = torch.abs(x)
    col = abs_x.sum(dim=-1)
    row = abs_x.sum(dim=-2)
    z = x.transpose(-1, -2) / (torch.max(col) * torch.max(row))
    I = torch.eye(x.shape[-1])[None]
    for _ in range(iters):
        xz = x @ z
        z = 0.25 * z @ (13 * I - (xz @ (15 * I - (xz @ (7 * I - xz)))))
    return z


class NystromAttention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=2, num_landmarks=4, pinv_iterations=6,
                 residual=True, residual_conv_kernel=5, eps=1e-8, dropout=0.):
        super().__init__()
        self.eps = eps
        inner_dim = heads * dim_head
        self.num_landmarks = num_landmarks
        self.pinv_iterations = pinv_iterations
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))
        self.residual = residual
        if residual:
            kernel_size = residual_conv_kernel
            padding = residual_conv_kernel // 2
            self.res_conv = nn.Conv2d(heads, heads, (kernel_size, 1), padding=(padding, 0), groups=heads, bias=False)

    def forward(self, x, mask=None):
        b, n, _, h, m, iters, eps = *x.shape, self.heads, self.num_landmarks, self.pinv_iterations, self.eps

        # pad so that sequence can be evenly divided into m landmarks
        remainder = n % m
        if remainder > 0:
            padding = m - (n % m)
            x = F.pad(x, (0, 0, padding, 0), value=0)
            if exists(mask):
                mask = F.pad(mask, (padding, 0), value=False)

        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.view(b, t.shape[1], h, -1).transpose(1, 2), (q, k, v))

        if exists(mask):
            mask = mask[:, None, :]  # 'b n -> b () n'
            q, k, v = map(lambda t: t * mask[..., None], (q, k, v))

        q = q * self.scale

        l = ceil(n / m)
        q_landmarks = q.reshape(*q.shape[:2], -1, l, q.shape[-1]).sum(dim=-2)   # '... (n l) d -> ... n d'
        k_landmarks = k.reshape(*k.shape[:2], -1, l, k.shape[-1]).sum(dim=-2)

        divisor = l
        if exists(mask):
            mask_landmarks_sum = mask.reshape(*mask.shape[:2], -1, l).sum(dim=-1)
            divisor = mask_landmarks_sum[..., None] + eps
            mask_landmarks = mask_landmarks_sum > 0

        q_landmarks = q_landmarks / divisor
        k_landmarks = k_landmarks / divisor

        sim1 = einsum('... i d, ... j d -> ... i j', q, k_landmarks)
        sim2 = einsum('... i d, ... j d -> ... i j', q_landmarks, k_landmarks)
        sim3 = einsum('... i d, ... j d -> ... i j', q_landmarks, k)

        if exists(mask):
            mask_value = -torch.finfo(q.dtype).max
            sim1.masked_fill_(~(mask[..., None] * mask_landmarks[..., None, :]), mask_value)
            sim2.masked_fill_(~(mask_landmarks[..., None] * mask_landmarks[..., None, :]), mask_value)
            sim3.masked_fill_(~(mask_landmarks[..., None] * mask[..., None, :]), mask_value)

        attn1, attn2, attn3 = map(lambda t: t.softmax(dim=-1), (sim1, sim2, sim3))
        attn2_inv = moore_penrose_iter_pinv(attn2, iters)
        out = (attn1 @ attn2_inv) @ (attn3 @ v)

        if self.residual:
            out = out + self.res_conv(v)

        out = out.transpose(1, 2).reshape(b, out.shape[2], -1)  # 'b h n d -> b n (h d)'
        out = self.to_out(out)
        if FIXED:
            out = out[:, -n:]
        else:
            out = out[:, :n]
        return out


dim = 32
attn = NystromAttention(dim, num_landmarks=4).eval()
n = 10  # not a multiple of 4 landmarks -> 2 padding rows added on the left
x = torch.randn(2, n, dim)
mask = torch.ones(2, n, dtype=torch.bool)

with torch.no_grad():
    out = attn(x, mask=mask)
    # reference: the caller left-pads to a multiple of num_landmarks itself, so no internal padding
    # happens; the real tokens are then the last n rows
    x_pad = F.pad(x, (0, 0, 2, 0))
    mask_pad = F.pad(mask, (2, 0), value=False)
    ref = attn(x_pad, mask=mask_pad)[:, -n:]

print("max |out(n=10, internal left padding) - out(pre-padded, last n rows)|: %.6f" % (out - ref).abs().max().item())
