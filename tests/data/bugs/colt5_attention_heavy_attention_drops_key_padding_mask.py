# lucidrains/CoLT5-attention commit 0f34926 ("fix masking in attention class"):
# Attention.forward builds the (null-kv padded) key padding mask for the routed key/values but calls
# self.attend(q, k, v) without it, so the heavy branch attends to padded context tokens.
import sys
import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def divisible_by(numer, denom):
    return (numer % denom) == 0


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class Attend(nn.Module):
    # colt5_attention/attend.py, flash path (F.scaled_dot_product_attention)
    def __init__(self, dropout=0., causal=False, use_flash=True):
        super().__init__()
        self.dropout = dropout
        self.causal = causal
        self.use_flash = use_flash

    def flash_attn(self, q, k, v, mask=None):
        _, heads, q_len, _, k_len = *q.shape, k.shape[-2]
        if exists(mask) and mask.ndim != 4:
            mask = mask[:, None, None, :]
            mask = mask.expand(-1, heads, q_len, -1)
        return F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.,
            is_causal=self.causal,
        )

    def forward(self, q, k, v, mask=None):
        return self.flash_attn(q, k, v, mask=mask)


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, multiply_keys_by_score=False, use_flash=True):
        super().__init__()
        self.heads = heads
        dim_hidden = dim_head * heads
        self.multiply_keys_by_score = multiply_keys_by_score
        self.norm = RMSNorm(dim)
        self.null_kv = nn.Parameter(torch.randn(2, heads, dim_head))
        self.attend = Attend(use_flash=use_flash)
        self.to_q = nn.Linear(dim, dim_hidden, bias=False)
        self.to_kv = nn.Linear(dim, dim_hidden * 2, bias=False)
        self.to_out = nn.Linear(dim_hidden, dim, bias=False)

    def forward(self, x, context=None, mask=None, normalized_scores_kv=None, normalized_scores_q=None):
        batch, h = x.shape[0], self.heads
        x = self.norm(x)
        if exists(context):
            context = self.norm(context)
        context = default(context, x)

        if context.ndim == 3:
            context = context[:, None]  # b n d -> b 1 n d

        if exists(normalized_scores_kv) and isinstance(normalized_scores_kv, torch.Tensor):
            if normalized_scores_kv.ndim == 2:
                normalized_scores_kv = normalized_scores_kv[:, None]
            normalized_scores_kv = normalized_scores_kv[:, :, None, :, None]  # b r n -> b r 1 n 1

        num_kv_routes = context.shape[1]

        q = self.to_q(x)
        b, n, _ = q.shape
        q = q.view(b, n, h, -1).transpose(1, 2)

        if exists(normalized_scores_q) and isinstance(normalized_scores_q, torch.Tensor):
            q = q * normalized_scores_q[:, None, :, None]

        assert divisible_by(h, num_kv_routes)
        heads_per_route = h // num_kv_routes

        # '(r h d) i -> r h d i'
        kv_weight = self.to_kv.weight.view(num_kv_routes, heads_per_route, -1, self.to_kv.weight.shape[-1])
        kv = einsum('r h d i, b r n i -> b r h n d', kv_weight, context)
        k, v = kv.chunk(2, dim=-1)

        if exists(normalized_scores_kv):
            v = v * normalized_scores_kv
            if self.multiply_keys_by_score:
                k = k * normalized_scores_kv

        k, v = map(lambda t: t.flatten(1, 2), (k, v))  # b r h n d -> b (r h) n d

        # null key values: 'h d -> b h 1 d'
        nk, nv = map(lambda t: t[None, :, None, :].expand(batch, -1, -1, -1), self.null_kv)
        k = torch.cat((nk, k), dim=-2)
        v = torch.cat((nv, v), dim=-2)

        # masking
        if exists(mask):
            if mask.ndim == 3:
                mask = mask[:, :, None, None, :].expand(-1, -1, heads_per_route, 1, -1).flatten(1, 2)  # b r j -> b (r h) 1 j
            else:
                mask = mask[:, None, None, :]  # b j -> b 1 1 j
            mask = F.pad(mask, (1, 0), value=True)

        # attention
        if FIXED:
            out = self.attend(q, k, v, mask=mask)
        else:
            out = self.attend(q, k, v)

        out = out.transpose(1, 2).reshape(b, n, -1)  # b h n d -> b n (h d)
        return self.to_out(out)


# heavy branch of ConditionalRoutedAttention: routed queries attend to routed key/values,
# with routed_tokens_kv_mask = mask[kv_batch_range, indices_kv]
dim = 32
heavy_attn = Attention(dim=dim, dim_head=16, heads=4).eval()

batch, n = 2, 12
x = torch.randn(batch, n, dim)
lengths = torch.tensor([12, 4])
mask = torch.arange(n)[None, :] < lengths[:, None]

num_heavy_q, num_heavy_kv = 4, 6
indices_q = torch.stack([torch.randperm(int(l))[:num_heavy_q].sort().values for l in lengths])
# the kv router always returns num_heavy_kv indices; row 1 has only 4 real tokens for 6 heavy slots, so
# 2 padding tokens are routed too, and routed_tokens_kv_mask marks them False
indices_kv = torch.stack([torch.arange(0, 12, 2), torch.tensor([0, 1, 2, 3, 6, 9])])
batch_range = torch.arange(batch)[:, None]
routed_q = x[batch_range, indices_q]
routed_kv = x[batch_range, indices_kv]
routed_kv_mask = mask[batch_range, indices_kv]
scores_q = torch.rand(batch, num_heavy_q)
scores_kv = torch.rand(batch, num_heavy_kv)

with torch.no_grad():
    out = heavy_attn(routed_q, context=routed_kv, mask=routed_kv_mask,
                     normalized_scores_kv=scores_kv, normalized_scores_q=scores_q)
    # reference: row 1 with only its valid routed key/values (padding routes dropped)
    keep = routed_kv_mask[1]
    ref = heavy_attn(routed_q[1:2], context=routed_kv[1:2, keep], mask=None,
                     normalized_scores_kv=scores_kv[1:2, keep], normalized_scores_q=scores_q[1:2])

print("padded routed kv in row 1:", int((~routed_kv_mask[1]).sum().item()))
print("max |heavy_attn(padded routed kv) - heavy_attn(valid routed kv only)| row 1: %.6f"
      % (out[1:2] - ref).abs().max().item())
