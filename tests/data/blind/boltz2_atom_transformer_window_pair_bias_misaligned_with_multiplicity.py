# Boltz-2 AtomTransformer (windowed atom attention with pair bias), jwohlwend/boltz#524.
# With multiplicity > 1 (several diffusion samples), the per-window attention pair bias is
# repeat_interleave'd after the window reshape, so query windows of sample m get the pair bias
# of another window; the fix expands the bias per sample before splitting it into windows.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import LayerNorm, Linear, Module

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class AttentionPairBias(nn.Module):
    """boltz/model/layers/attentionv2.py (compute_pair_bias=False, as in the atom transformer)."""

    def __init__(self, c_s, num_heads, inf=1e6):
        super().__init__()
        self.c_s = c_s
        self.num_heads = num_heads
        self.head_dim = c_s // num_heads
        self.inf = inf
        self.proj_q = nn.Linear(c_s, c_s)
        self.proj_k = nn.Linear(c_s, c_s, bias=False)
        self.proj_v = nn.Linear(c_s, c_s, bias=False)
        self.proj_g = nn.Linear(c_s, c_s, bias=False)
        self.proj_o = nn.Linear(c_s, c_s, bias=False)

    def proj_z(self, z):  # Rearrange("b ... h -> b h ...")
        return z.permute(0, 3, 1, 2)

    def forward(self, s: Tensor, z: Tensor, mask: Tensor, k_in: Tensor, multiplicity: int = 1) -> Tensor:
        B = s.shape[0]
        q = self.proj_q(s).view(B, -1, self.num_heads, self.head_dim)
        k = self.proj_k(k_in).view(B, -1, self.num_heads, self.head_dim)
        v = self.proj_v(k_in).view(B, -1, self.num_heads, self.head_dim)

        bias = self.proj_z(z)
        bias = bias.repeat_interleave(multiplicity, 0)

        g = self.proj_g(s).sigmoid()
        attn = torch.einsum("bihd,bjhd->bhij", q.float(), k.float())
        attn = attn / (self.head_dim**0.5) + bias.float()
        attn = attn + (1 - mask[:, None, None].float()) * -self.inf
        attn = attn.softmax(dim=-1)
        o = torch.einsum("bhij,bjhd->bihd", attn, v.float()).to(v.dtype)
        o = o.reshape(B, -1, self.c_s)
        return self.proj_o(g * o)


class AdaLN(Module):
    def __init__(self, dim, dim_single_cond):
        super().__init__()
        self.a_norm = LayerNorm(dim, elementwise_affine=False, bias=False)
        self.s_norm = LayerNorm(dim_single_cond, bias=False)
        self.s_scale = Linear(dim_single_cond, dim)
        self.s_bias = Linear(dim_single_cond, dim, bias=False)

    def forward(self, a, s):
        a = self.a_norm(a)
        s = self.s_norm(s)
        return torch.sigmoid(self.s_scale(s)) * a + self.s_bias(s)


class DiffusionTransformerLayer(Module):
    def __init__(self, heads, dim, dim_single_cond):
        super().__init__()
        self.adaln = AdaLN(dim, dim_single_cond)
        self.pair_bias_attn = AttentionPairBias(c_s=dim, num_heads=heads)
        self.output_projection_linear = Linear(dim_single_cond, dim)
        nn.init.constant_(self.output_projection_linear.bias, -2.0)
        self.output_projection = nn.Sequential(self.output_projection_linear, nn.Sigmoid())
        self.transition = nn.Sequential(LayerNorm(dim), Linear(dim, 2 * dim), nn.SiLU(), Linear(2 * dim, dim))

    def forward(self, a, s, bias=None, mask=None, to_keys=None, multiplicity=1):
        b = self.adaln(a, s)
        k_in = b
        if to_keys is not None:
            k_in = to_keys(b)
            mask = to_keys(mask.unsqueeze(-1)).squeeze(-1)
        b = self.pair_bias_attn(s=b, z=bias, mask=mask, multiplicity=multiplicity, k_in=k_in)
        b = self.output_projection(s) * b
        a = a + b
        a = a + self.transition(a)
        return a


class DiffusionTransformer(Module):
    def __init__(self, depth, heads, dim, dim_single_cond):
        super().__init__()
        self.layers = nn.ModuleList(
            [DiffusionTransformerLayer(heads, dim, dim_single_cond) for _ in range(depth)]
        )

    def forward(self, a, s, bias=None, mask=None, to_keys=None, multiplicity=1):
        B, N, M, D = bias.shape
        L = len(self.layers)
        bias = bias.view(B, N, M, L, D // L)
        for i, layer in enumerate(self.layers):
            bias_l = bias[:, :, :, i]
            a = layer(a, s, bias_l, mask, to_keys, multiplicity)
        return a


class AtomTransformer(Module):
    """Algorithm 7"""

    def __init__(self, attn_window_queries, attn_window_keys, **diffusion_transformer_kwargs):
        super().__init__()
        self.attn_window_queries = attn_window_queries
        self.attn_window_keys = attn_window_keys
        self.diffusion_transformer = DiffusionTransformer(**diffusion_transformer_kwargs)

    def forward(self, q, c, bias, to_keys, mask, multiplicity=1):
        W = self.attn_window_queries
        H = self.attn_window_keys
        B, N, D = q.shape
        NW = N // W

        # reshape tokens
        q = q.view((B * NW, W, -1))
        c = c.view((B * NW, W, -1))
        mask = mask.view(B * NW, W)
        if FIXED:
            bias = bias.repeat_interleave(multiplicity, 0)
        bias = bias.view((bias.shape[0] * NW, W, H, -1))

        to_keys_new = lambda x: to_keys(x.view(B, NW * W, -1)).view(B * NW, H, -1)

        q = self.diffusion_transformer(
            a=q, s=c, bias=bias, mask=mask.float(),
            multiplicity=1 if FIXED else multiplicity,  # bias term already expanded with multiplicity
            to_keys=to_keys_new,
        )
        q = q.view((B, NW * W, D))
        return q


def get_indexing_matrix(K, W, H, device):
    h = H // (W // 2)
    arange = torch.arange(2 * K, device=device)
    index = ((arange.unsqueeze(0) - arange.unsqueeze(1)) + h // 2).clamp(min=0, max=h + 1)
    index = index.view(K, 2, 2 * K)[:, 0, :]
    onehot = F.one_hot(index, num_classes=h + 2)[..., 1:-1].transpose(1, 0)
    return onehot.reshape(2 * K, h * K).float()


def single_to_keys(single, indexing_matrix, W, H):
    B, N, D = single.shape
    K = N // W
    single = single.view(B, 2 * K, W // 2, D)
    return torch.einsum("b j i d, j k -> b k i d", single, indexing_matrix).reshape(B, K, H, D)


# sizes: 16 atoms, query windows of 4, key windows of 8, 2 layers x 4 heads
W, H, N, atom_s, heads, depth = 4, 8, 16, 32, 4, 2
K = N // W
atom_encoder = AtomTransformer(attn_window_queries=W, attn_window_keys=H, depth=depth,
                               heads=heads, dim=atom_s, dim_single_cond=atom_s).eval()
to_keys = partial(single_to_keys, indexing_matrix=get_indexing_matrix(K, W, H, "cpu"), W=W, H=H)

B, multiplicity = 1, 3
c = torch.randn(B, N, atom_s)
atom_enc_bias = 2.0 * torch.randn(B, K, W, H, heads * depth)
atom_mask = torch.ones(B, N, dtype=torch.bool)
atom_mask[:, 14:] = False  # padded atoms
r_to_q = torch.randn(B * multiplicity, N, atom_s)  # a different noisy structure per diffusion sample

with torch.no_grad():
    # AtomAttentionEncoder: q/c/mask repeat_interleave'd per sample, bias passed once
    q = c.repeat_interleave(multiplicity, 0) + r_to_q
    out = atom_encoder(q=q, mask=atom_mask.repeat_interleave(multiplicity, 0),
                       c=c.repeat_interleave(multiplicity, 0), bias=atom_enc_bias,
                       multiplicity=multiplicity, to_keys=to_keys)
    # reference: each diffusion sample on its own (multiplicity=1)
    max_diff = 0.0
    for m in range(multiplicity):
        ref = atom_encoder(q=c + r_to_q[m:m + 1], mask=atom_mask, c=c, bias=atom_enc_bias,
                           multiplicity=1, to_keys=to_keys)
        max_diff = max(max_diff, (out[m][atom_mask[0]] - ref[0][atom_mask[0]]).abs().max().item())
print(f"max |multiplicity=3 - per-sample| atom repr: {max_diff:.6f}")
