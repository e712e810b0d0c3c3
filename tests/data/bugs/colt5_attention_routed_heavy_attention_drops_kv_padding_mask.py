# lucidrains/CoLT5-attention, fixed in commit 0f34926 ("fix masking in attention class"), colt5_attention/transformer_block.py.
# Attention (the heavy branch of ConditionalRoutedAttention) builds the key padding mask of the routed key/values
# (padded for the null kv) but calls self.attend(q, k, v) without it, so routed padding tokens are still attended.
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
warnings.filterwarnings("ignore")


# ---- helper functions (transformer_block.py); einops calls written out with torch ops ----
def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def divisible_by(numer, denom):
    return (numer % denom) == 0


def create_batch_range(t, right_pad_dims=1):
    b, device = t.shape[0], t.device
    batch_range = torch.arange(b, device=device)
    pad_dims = ((1,) * right_pad_dims)
    return batch_range.reshape(-1, *pad_dims)


def batched_gather(x, indices):
    batch_range = create_batch_range(indices, indices.ndim - 1)
    return x[batch_range, indices]


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = F.normalize(x, dim=-1)
        return normed * self.scale * self.gamma


# ---- colt5_attention/attend.py (flash path = F.scaled_dot_product_attention) ----
class Attend(nn.Module):
    def __init__(self, dropout=0., causal=False, use_flash=False):
        super().__init__()
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)
        self.causal = causal
        self.use_flash = use_flash
        self.cpu_config = dict(enable_flash=True, enable_math=True, enable_mem_efficient=True)

    def flash_attn(self, q, k, v, mask=None):
        _, heads, q_len, _, k_len, is_cuda = *q.shape, k.shape[-2], q.is_cuda
        if exists(mask) and mask.ndim != 4:
            mask = mask[:, None, None, :]                     # rearrange(mask, 'b j -> b 1 1 j')
            mask = mask.expand(-1, heads, q_len, -1)
        with torch.backends.cuda.sdp_kernel(**self.cpu_config):
            out = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=mask,
                dropout_p=self.dropout if self.training else 0.,
                is_causal=self.causal
            )
        return out

    def forward(self, q, k, v, mask=None):
        if self.use_flash:
            return self.flash_attn(q, k, v, mask=mask)
        scale = q.shape[-1] ** -0.5
        sim = einsum("b h i d, b h j d -> b h i j", q, k) * scale
        if exists(mask):
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)
        return einsum("b h i j, b h j d -> b h i d", attn, v)


# ---- colt5_attention/transformer_block.py: Attention (heavy branch) ----
class Attention(nn.Module):
    def __init__(self, dim, dim_head=64, heads=8, multiply_keys_by_score=False, use_flash=False):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
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
            context = context[:, None]                        # 'b n d -> b 1 n d'
        if exists(normalized_scores_kv) and isinstance(normalized_scores_kv, torch.Tensor):
            if normalized_scores_kv.ndim == 2:
                normalized_scores_kv = normalized_scores_kv[:, None]      # 'b n -> b 1 n'
            normalized_scores_kv = normalized_scores_kv[:, :, None, :, None]  # 'b r n -> b r 1 n 1'
        num_kv_routes = context.shape[1]

        q = self.to_q(x)
        q = q.view(batch, q.shape[1], h, -1).transpose(1, 2)  # 'b n (h d) -> b h n d'
        if exists(normalized_scores_q) and isinstance(normalized_scores_q, torch.Tensor):
            q = q * normalized_scores_q[:, None, :, None]

        assert divisible_by(h, num_kv_routes)
        heads_per_route = h // num_kv_routes
        d2 = self.to_kv.weight.shape[0] // (num_kv_routes * heads_per_route)
        kv_weight = self.to_kv.weight.view(num_kv_routes, heads_per_route, d2, -1)  # '(r h d) i -> r h d i'
        kv = einsum('r h d i, b r n i -> b r h n d', kv_weight, context)
        k, v = kv.chunk(2, dim=-1)

        if exists(normalized_scores_kv):
            v = v * normalized_scores_kv
            if self.multiply_keys_by_score:
                k = k * normalized_scores_kv

        k, v = map(lambda t: t.flatten(1, 2), (k, v))          # 'b r h n d -> b (r h) n d'

        nk, nv = map(lambda t: t[None, :, None].expand(batch, -1, -1, -1), self.null_kv)  # 'h d -> b h 1 d'
        k = torch.cat((nk, k), dim=-2)
        v = torch.cat((nv, v), dim=-2)

        # masking
        if exists(mask):
            if mask.ndim == 3:
                mask = mask[:, :, None, None, :].expand(-1, -1, heads_per_route, 1, -1).flatten(1, 2)
            else:
                mask = mask[:, None, None, :]                 # 'b j -> b 1 1 j'
            mask = F.pad(mask, (1, 0), value=True)

        # attention
        if FIXED:
            out = self.attend(q, k, v, mask=mask)
        else:
            out = self.attend(q, k, v)

        out = out.transpose(1, 2).flatten(2)                  # 'b h n d -> b n (h d)'
        return self.to_out(out)


# ---- colt5_attention/coor_descent.py ----
def log(t, eps=1e-20):
    return torch.log(t.clamp(min=eps))


def coor_descent(s, *, n_iters, k, eps=1e-1, mask=None):
    mask_value = -torch.finfo(s.dtype).max
    if not isinstance(k, torch.Tensor):
        k = torch.Tensor([k]).to(s)
    else:
        k = k[..., None]
    constant = eps * log(k)
    if exists(mask):
        s = s.masked_fill(~mask, mask_value)
    a = 0
    b = -s
    for _ in range(n_iters):
        sb = ((s + b) / eps)
        if exists(mask):
            sb = sb.masked_fill(~mask, mask_value)
        a = constant - eps * sb.logsumexp(dim=-1, keepdim=True)
        b = -F.relu(s + a)
    scores = ((s + a + b) / eps).exp()
    if exists(mask):
        scores = scores.masked_fill(~mask, 0.)
    return scores


# ---- CoordinateDescentRouter (one routing token, no route blocks) ----
class CoordinateDescentRouter(nn.Module):
    def __init__(self, dim, straight_through=True, n_iters=50, fetch_k_ratio=9 / 8, eps=1.):
        super().__init__()
        self.eps = eps
        self.n_iters = n_iters
        self.fetch_k_ratio = fetch_k_ratio
        self.coor_descent = coor_descent
        self.routing_token = nn.Parameter(torch.randn(1, dim))
        self.straight_through = straight_through

    def route_back(self, src, routed_tokens, indices):
        batch_range = create_batch_range(routed_tokens)
        src[batch_range, indices] = routed_tokens
        return src

    def forward(self, x, *, num_tokens, mask=None):
        n, device, eps = x.shape[-2], x.device, self.eps
        s = einsum('b n d, r d -> b r n', x, self.routing_token)
        s = s.flatten(0, 1)                                   # pack_one(s, '* n') with one routing token
        effective_k = min(num_tokens * self.fetch_k_ratio, n)
        k = torch.tensor([effective_k], device=device)
        scores = self.coor_descent(s, n_iters=self.n_iters, mask=mask, k=k, eps=eps)
        selected_scores, selected_indices = scores.topk(num_tokens, dim=-1)
        if self.straight_through:
            selected_scores = selected_scores + (1. - selected_scores).detach()
            if exists(mask):
                selected_mask = batched_gather(mask, selected_indices)
                selected_scores = selected_scores.masked_fill(~selected_mask, 0.)
        return selected_scores, selected_indices


# ---- ConditionalRoutedAttention.forward, heavy branch (the light LocalMHA branch comes from the external
#      local-attention package and does not touch the routed key/values; it is left out here) ----
class ConditionalRoutedAttention(nn.Module):
    def __init__(self, dim, *, num_heavy_tokens_q, num_heavy_tokens_kv, heavy_dim_head=8, heavy_heads=4):
        super().__init__()
        self.num_heavy_tokens_q = num_heavy_tokens_q
        self.num_heavy_tokens_kv = num_heavy_tokens_kv
        self.multiply_queries_by_score = False
        self.null_q_token = None
        self.q_router = CoordinateDescentRouter(dim=dim)
        self.kv_router = CoordinateDescentRouter(dim=dim)
        self.heavy_attn = Attention(dim=dim, dim_head=heavy_dim_head, heads=heavy_heads, use_flash=True)

    def forward(self, x, *, mask=None):
        num_heavy_tokens_q = self.num_heavy_tokens_q
        num_heavy_tokens_kv = self.num_heavy_tokens_kv
        normalized_scores_q, indices_q = self.q_router(x, num_tokens=num_heavy_tokens_q, mask=mask)
        normalized_scores_kv, indices_kv = self.kv_router(x, num_tokens=num_heavy_tokens_kv, mask=mask)
        routed_tokens_q = batched_gather(x, indices_q)
        kv_batch_range = create_batch_range(x, right_pad_dims=indices_kv.ndim - 1)
        routed_tokens_kv = batched_gather(x, indices_kv)
        routed_tokens_kv_mask = None
        if exists(mask):
            routed_tokens_kv_mask = mask[kv_batch_range, indices_kv]
        routed_tokens_out = self.heavy_attn(
            routed_tokens_q,
            mask=routed_tokens_kv_mask,
            context=routed_tokens_kv,
            normalized_scores_kv=normalized_scores_kv,
            normalized_scores_q=normalized_scores_q if self.multiply_queries_by_score else None
        )
        routed_tokens_out = routed_tokens_out * normalized_scores_q[..., None]
        heavy_out = torch.zeros_like(x)
        heavy_out = self.q_router.route_back(heavy_out, routed_tokens_out, indices_q)
        return heavy_out


B, N, D = 2, 16, 32
attn = ConditionalRoutedAttention(D, num_heavy_tokens_q=8, num_heavy_tokens_kv=12).eval()
x = torch.randn(B, N, D)
mask = torch.ones(B, N, dtype=torch.bool)
mask[1, 10:] = False            # second sequence: 10 real tokens, 6 padding tokens

with torch.no_grad():
    out = attn(x, mask=mask)
    x2 = x.clone()
    x2[1, 10:] = torch.randn(N - 10, D) * 3.0   # change only the padding tokens
    out2 = attn(x2, mask=mask)
    routed_pad_kv = (~mask[1][attn.kv_router(x, num_tokens=12, mask=mask)[1][1]]).sum().item()

diff = (out[1, :10] - out2[1, :10]).abs().max().item()
print(f"padding tokens routed to the heavy key/values: {routed_pad_kv}")
print(f"max change of real-token outputs when only padding tokens change: {diff:.3e}")
