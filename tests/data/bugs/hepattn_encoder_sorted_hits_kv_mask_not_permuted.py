# hepattn (samvanstroud/hepattn commit c85cf35, "fix encoder bug where kv mask is not permuted"): the
# Encoder sorts the hit tokens by x_sort_value (e.g. phi) but leaves the kv_mask (hit padding mask) in the
# original order, so after sorting the padding mask hides real hits and lets padded hits be attended.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import BoolTensor, Size, Tensor, nn
from torch.nn.functional import scaled_dot_product_attention

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- hepattn/models/activation.py ----
class SwiGLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return x1 * F.silu(x2)


# ---- hepattn/models/dense.py (trimmed) ----
class Dense(nn.Module):
    def __init__(self, input_size, output_size=None, hidden_dim_scale=2, bias=True):
        super().__init__()
        output_size = output_size or input_size
        hidden = input_size * hidden_dim_scale
        self.net = nn.Sequential(nn.Linear(input_size, hidden * 2, bias=bias), SwiGLU(),
                                 nn.Linear(hidden, output_size, bias=bias))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


# ---- hepattn/models/attention.py (torch backend) ----
def merge_masks(q_mask, kv_mask, attn_mask, q_shape: Size, k_shape: Size, device) -> BoolTensor:
    """True slots are involved in computation / not masked out."""
    merged_mask = None
    if q_mask is not None or kv_mask is not None:
        if q_mask is None:
            q_mask = torch.full(q_shape[:-1], True, device=device)
        if kv_mask is None:
            kv_mask = torch.full(k_shape[:-1], True, device=device)
        merged_mask = q_mask.unsqueeze(-1) & kv_mask.unsqueeze(-2)
    if attn_mask is not None:
        merged_mask = attn_mask & merged_mask if merged_mask is not None else attn_mask
    return merged_mask


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, bias=True, attn_type="torch", qkv_norm=False, **kwargs):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.attn_type = attn_type
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim)) if bias else None
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            nn.init.constant_(self.in_proj_bias, 0.0)
        self.attn = scaled_dot_product_attention

    def separate_heads(self, x, num_heads):
        return x.unflatten(-1, (num_heads, -1)).transpose(-3, -2)  # B S D -> B H S Dh

    def recombine_heads(self, x):
        return x.transpose(-3, -2).flatten(-2)

    def forward(self, q, kv=None, q_mask=None, kv_mask=None, attn_mask=None, attn_bias=None, score_mod=None,
                initial_values=None, **kwargs):
        q_shape = kv_shape = q.shape if kv is None else None
        if kv is None:
            kv = q
        qh, k, v = F._in_projection_packed(q, kv, kv, self.in_proj_weight, self.in_proj_bias)  # noqa: SLF001
        qh, k, v = (self.separate_heads(t, self.num_heads) for t in (qh, k, v))
        attn_mask = merge_masks(q_mask, kv_mask, attn_mask, q_shape, kv_shape, qh.device)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(-3)
        out = self.attn(qh, k, v, attn_mask=attn_mask)
        return self.out_proj(self.recombine_heads(out))


# ---- hepattn/models/transformer.py ----
class Residual(nn.Module):
    def __init__(self, fn, dim, norm, post_norm=False):
        super().__init__()
        self.fn = fn
        self.post_norm = post_norm
        self.norm = getattr(nn, norm)(dim, elementwise_affine=False) if norm else nn.Identity()

    def forward(self, x, **kwargs):
        if self.post_norm:
            x = self.norm(x)
            return x + self.fn(x, **kwargs)
        return x + self.fn(self.norm(x), **kwargs)


class EncoderLayer(nn.Module):
    def __init__(self, dim, depth=0, norm="LayerNorm", attn_kwargs=None):
        super().__init__()
        attn_kwargs = attn_kwargs or {}
        residual = partial(Residual, dim=dim)
        self.attn = residual(Attention(dim, **attn_kwargs), norm=norm)
        self.dense = residual(Dense(dim), norm=norm, post_norm=True)

    def forward(self, x, **kwargs):
        return self.dense(self.attn(x, **kwargs))


class Encoder(nn.Module):
    def __init__(self, num_layers, dim, attn_type="torch", **layer_kwargs):
        super().__init__()
        self.attn_type = attn_type
        attn_kwargs = {"attn_type": attn_type, "num_heads": 4}
        self.layers = nn.ModuleList([EncoderLayer(dim=dim, depth=i, attn_kwargs=attn_kwargs) for i in range(num_layers)])

    def forward(self, x: Tensor, x_sort_value: Tensor | None = None, **kwargs) -> Tensor:
        # If value to sort on is provided, use it to sort the tokens
        x_sort_idx = None
        if x_sort_value is not None:
            x_sort_idx = torch.argsort(x_sort_value, axis=-1)
            x = torch.gather(x, -2, x_sort_idx.unsqueeze(-1).expand_as(x))
            if FIXED:
                # Also permute the kv mask if we have one
                if kwargs.get("kv_mask") is not None:
                    kwargs["kv_mask"] = torch.gather(kwargs["kv_mask"], dim=1, index=x_sort_idx)

        attn_mask = None
        for layer in self.layers:
            x = layer(x, attn_mask=attn_mask, **kwargs)

        # If we sorted the tokens, undo the sorting
        if x_sort_value is not None and x_sort_idx is not None:
            x_unsort_idx = torch.argsort(x_sort_idx, axis=-1)
            x = torch.gather(x, -2, x_unsort_idx.unsqueeze(-1).expand_as(x))
        return x


dim = 32
encoder = Encoder(num_layers=2, dim=dim).eval()

# two events with 16 and 9 hits, padded to 16 hits; hits are sorted by phi inside the encoder
n_hits = [16, 9]
H = max(n_hits)
x = torch.zeros(2, H, dim)
phi = torch.zeros(2, H)
kv_mask = torch.zeros(2, H, dtype=torch.bool)  # True = real hit
for b, n in enumerate(n_hits):
    x[b, :n] = torch.randn(n, dim)
    phi[b, :n] = torch.rand(n) * 2 * torch.pi - torch.pi
    phi[b, n:] = torch.rand(H - n) * 2 * torch.pi - torch.pi  # padded hits carry arbitrary phi
    x[b, n:] = torch.randn(H - n, dim)  # padded slots hold garbage
    kv_mask[b, :n] = True

with torch.no_grad():
    batched = encoder(x, x_sort_value=phi, kv_mask=kv_mask)
    # reference: the short event alone, without padding
    n = n_hits[1]
    alone = encoder(x[1:2, :n], x_sort_value=phi[1:2, :n])

diff = (batched[1, :n] - alone[0]).abs().max().item()
print(f"fixed={FIXED}")
print(f"max |padded-batch output - event-alone output| over the real hits of the 9-hit event: {diff:.6f}")
