"""Boltz's Pairformer trunk over a padded batch of protein complexes, as jwohlwend/boltz writes it.

Citation: jwohlwend/boltz src/boltz/model/layers/pairformer.py @304e928accacfa06d80da2c0c501fff00d79bc57
(PairformerLayer.forward, the non-flash branch; PairformerModule.forward), src/boltz/model/layers/attentionv2.py
@98030085e867b27ed3fb68a4c9c896794cae7803 (AttentionPairBias: `attn + (1 - mask[:, None, None].float()) * -self.inf`),
src/boltz/model/layers/triangular_mult.py @304e928accacfa06d80da2c0c501fff00d79bc57 (TriangleMultiplicationOutgoing /
Incoming: `x = x * mask.unsqueeze(-1)` before the triangle einsum), src/boltz/model/layers/transition.py (Transition).

Trimmed: no triangle attention (OpenFold's kernel), no dropout (eval), no cuequivariance kernels; einops'
Rearrange written as a permute; the zero "final_init_" of the output projections replaced by PyTorch's default
init so that each block changes its stream. Tokens are right-padded to the longest complex; `mask` is the token
mask (B, N) and `pair_mask` its outer product (B, N, N), as Boltz's featurizer gives them to the trunk.

Self-check: every real token's single representation s and every real pair (i, j) of z after two Pairformer
layers equal the same layers run on that complex alone, unpadded, with an all-ones mask.
"""

import sys
from typing import Optional

import torch
from torch import Tensor, nn

torch.manual_seed(0)


class Transition(nn.Module):
    """Perform a two-layer MLP."""

    def __init__(self, dim: int = 128, hidden: int = 512, out_dim: Optional[int] = None) -> None:
        super().__init__()
        if out_dim is None:
            out_dim = dim
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(dim, hidden, bias=False)
        self.fc3 = nn.Linear(hidden, out_dim, bias=False)
        self.silu = nn.SiLU()
        self.hidden = hidden

    def forward(self, x: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        x = self.norm(x)
        fc1 = self.fc1(x)
        fc2 = self.fc2(x)
        hidden = self.silu(fc1) * fc2
        return self.fc3(hidden)


class AttentionPairBias(nn.Module):
    """Attention pair bias layer."""

    def __init__(self, c_s: int, c_z: Optional[int] = None, num_heads: Optional[int] = None,
                 inf: float = 1e6, compute_pair_bias: bool = True) -> None:
        super().__init__()
        assert c_s % num_heads == 0
        self.c_s = c_s
        self.num_heads = num_heads
        self.head_dim = c_s // num_heads
        self.inf = inf

        self.proj_q = nn.Linear(c_s, c_s)
        self.proj_k = nn.Linear(c_s, c_s, bias=False)
        self.proj_v = nn.Linear(c_s, c_s, bias=False)
        self.proj_g = nn.Linear(c_s, c_s, bias=False)

        self.proj_z_norm = nn.LayerNorm(c_z)
        self.proj_z_lin = nn.Linear(c_z, num_heads, bias=False)

        self.proj_o = nn.Linear(c_s, c_s, bias=False)

    def proj_z(self, z: Tensor) -> Tensor:
        # nn.Sequential(LayerNorm, Linear(c_z, num_heads), Rearrange("b ... h -> b h ..."))
        return self.proj_z_lin(self.proj_z_norm(z)).permute(0, 3, 1, 2)

    def forward(self, s: Tensor, z: Tensor, mask: Tensor, k_in: Tensor, multiplicity: int = 1) -> Tensor:
        B = s.shape[0]

        # Compute projections
        q = self.proj_q(s).view(B, -1, self.num_heads, self.head_dim)
        k = self.proj_k(k_in).view(B, -1, self.num_heads, self.head_dim)
        v = self.proj_v(k_in).view(B, -1, self.num_heads, self.head_dim)

        bias = self.proj_z(z)
        bias = bias.repeat_interleave(multiplicity, 0)

        g = self.proj_g(s).sigmoid()

        with torch.autocast(device_type=q.device.type, enabled=False):
            # Compute attention weights
            attn = torch.einsum("bihd,bjhd->bhij", q.float(), k.float())
            attn = attn / (self.head_dim**0.5) + bias.float()
            attn = attn + (1 - mask[:, None, None].float()) * -self.inf
            attn = attn.softmax(dim=-1)

            # Compute output
            o = torch.einsum("bhij,bjhd->bihd", attn, v.float()).to(v.dtype)
        o = o.reshape(B, -1, self.c_s)
        o = self.proj_o(g * o)

        return o


class TriangleMultiplicationOutgoing(nn.Module):
    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.norm_in = nn.LayerNorm(dim, eps=1e-5)
        self.p_in = nn.Linear(dim, 2 * dim, bias=False)
        self.g_in = nn.Linear(dim, 2 * dim, bias=False)
        self.norm_out = nn.LayerNorm(dim)
        self.p_out = nn.Linear(dim, dim, bias=False)
        self.g_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor, mask: Tensor, use_kernels: bool = False) -> Tensor:
        # Input gating: D -> D
        x = self.norm_in(x)
        x_in = x
        x = self.p_in(x) * self.g_in(x).sigmoid()

        # Apply mask
        x = x * mask.unsqueeze(-1)

        # Split input and cast to float
        a, b = torch.chunk(x.float(), 2, dim=-1)

        # Triangular projection
        x = torch.einsum("bikd,bjkd->bijd", a, b)

        # Output gating
        x = self.p_out(self.norm_out(x)) * self.g_out(x_in).sigmoid()
        return x


class TriangleMultiplicationIncoming(TriangleMultiplicationOutgoing):
    def forward(self, x: Tensor, mask: Tensor, use_kernels: bool = False) -> Tensor:
        x = self.norm_in(x)
        x_in = x
        x = self.p_in(x) * self.g_in(x).sigmoid()

        # Apply mask
        x = x * mask.unsqueeze(-1)

        a, b = torch.chunk(x.float(), 2, dim=-1)

        # Triangular projection
        x = torch.einsum("bkid,bkjd->bijd", a, b)

        x = self.p_out(self.norm_out(x)) * self.g_out(x_in).sigmoid()
        return x


class PairformerLayer(nn.Module):
    """Pairformer module."""

    def __init__(self, token_s: int, token_z: int, num_heads: int = 16, post_layer_norm: bool = False) -> None:
        super().__init__()
        self.token_z = token_z
        self.num_heads = num_heads
        self.post_layer_norm = post_layer_norm

        self.pre_norm_s = nn.LayerNorm(token_s)
        self.attention = AttentionPairBias(token_s, token_z, num_heads)

        self.tri_mul_out = TriangleMultiplicationOutgoing(token_z)
        self.tri_mul_in = TriangleMultiplicationIncoming(token_z)

        self.transition_s = Transition(token_s, token_s * 4)
        self.transition_z = Transition(token_z, token_z * 4)

        self.s_post_norm = nn.LayerNorm(token_s) if self.post_layer_norm else nn.Identity()

    def forward(self, s: Tensor, z: Tensor, mask: Tensor, pair_mask: Tensor) -> tuple[Tensor, Tensor]:
        # Compute pairwise stack
        z = z + self.tri_mul_out(z, mask=pair_mask)
        z = z + self.tri_mul_in(z, mask=pair_mask)
        z = z + self.transition_z(z)

        # Compute sequence stack
        with torch.autocast(device_type=z.device.type, enabled=False):
            s_normed = self.pre_norm_s(s.float())
            s = s.float() + self.attention(s=s_normed, z=z.float(), mask=mask.float(), k_in=s_normed)
            s = s + self.transition_s(s)
            s = self.s_post_norm(s)

        return s, z


class PairformerModule(nn.Module):
    def __init__(self, token_s: int, token_z: int, num_blocks: int, num_heads: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([PairformerLayer(token_s, token_z, num_heads) for _ in range(num_blocks)])

    def forward(self, s: Tensor, z: Tensor, mask: Tensor, pair_mask: Tensor) -> tuple[Tensor, Tensor]:
        for layer in self.layers:
            s, z = layer(s, z, mask, pair_mask)
        return s, z


def main() -> int:
    token_s, token_z = 32, 16
    model = PairformerModule(token_s, token_z, num_blocks=2, num_heads=4).eval()

    lengths = [9, 6, 4]
    N = max(lengths)
    B = len(lengths)

    s_list = [torch.randn(n, token_s) for n in lengths]
    z_list = [torch.randn(n, n, token_z) for n in lengths]

    # Boltz's featurizer pads tokens to the longest complex; token_pad_mask is 1 on real tokens.
    s = torch.zeros(B, N, token_s)
    z = torch.zeros(B, N, N, token_z)
    mask = torch.zeros(B, N)
    for b, n in enumerate(lengths):
        s[b, :n] = s_list[b]
        z[b, :n, :n] = z_list[b]
        mask[b, :n] = 1.0
    pair_mask = mask[:, :, None] * mask[:, None, :]

    with torch.no_grad():
        s_out, z_out = model(s, z, mask, pair_mask)

        worst = 0.0
        for b, n in enumerate(lengths):
            one = torch.ones(1, n)
            s_ref, z_ref = model(s_list[b][None], z_list[b][None], one, one[:, :, None] * one[:, None, :])
            ds = (s_out[b, :n] - s_ref[0]).abs().max().item()
            dz = (z_out[b, :n, :n] - z_ref[0]).abs().max().item()
            worst = max(worst, ds, dz)
            print(f"complex {b}: {n} tokens, max |s - ref| = {ds:.2e}, max |z - ref| = {dz:.2e}")

    if worst > 1e-4:
        print("FAIL: padded batch differs from per-complex runs")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
