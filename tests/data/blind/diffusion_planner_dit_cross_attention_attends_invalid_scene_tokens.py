"""tier4/Diffusion-Planner DiT: the cross-attention to the scene encoding attends the invalid (masked) tokens.

Citation: tier4/Diffusion-Planner PR #156 (merged as commit 37e511d1, "fix: update DiTBlock forward method to
include cross attention mask and modify Encoder to mask outputs based on encoding mask"). Pre-fix
model/module/dit.py and encoder.py and the fix diff were read.

Bug: the scene encoder concatenates ego, neighbor, lane, route, ... tokens with an `encoding_mask` (True =
invalid slot) and its fusion self-attention honours it as key_padding_mask, but `Encoder.forward` returns the
fused outputs of the invalid slots unchanged, and `DiTBlock.forward` runs
`self.cross_attn(self.norm3(x), cross_c, cross_c, need_weights=False)` with no mask at all, so every agent
query of the diffusion transformer attends the absent neighbors / lanes.

Fix: the encoder zeroes the invalid outputs (`encoder_outputs.masked_fill(encoding_mask..., 0.0)`), `DiT.forward`
derives `cross_attn_mask = torch.all(cross_c == 0, dim=-1)` and each block passes it as
`key_padding_mask=cross_attn_mask` to the cross-attention.

This program condenses the encoder to its fusion block over precomputed token encodings (T=81, D=4 trajectories,
hidden 32), two scenes with 2 and 5 valid scene tokens of 6, and runs the DiT once. timm's Mlp is written out.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Mlp(nn.Module):
    """timm.models.layers.Mlp"""

    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


def modulate(x, shift, scale):
    x = x * (1 + scale) + shift
    return x


class SelfAttentionBlock(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * 4.0), act_layer=nn.GELU, drop=dropout)

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x), self.norm1(x), self.norm1(x), key_padding_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return x


class Encoder(nn.Module):
    """Condensed: the per-type encoders are replaced by their concatenated outputs."""

    def __init__(self, dim, heads, dropout, token_num):
        super().__init__()
        self.token_num = token_num
        self.fusion = SelfAttentionBlock(dim, heads, dropout)

    def forward(self, encoding_input, encoding_mask):
        B = encoding_input.shape[0]
        encoder_outputs = self.fusion(encoding_input, encoding_mask.view(B, self.token_num))
        if FIXED:
            encoder_outputs = encoder_outputs.masked_fill(encoding_mask.view(B, self.token_num, 1), 0.0)
        return encoder_outputs


class DiTBlock(nn.Module):
    def __init__(self, dim=192, heads=6, dropout=0.1, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        mlp_hidden_dim = int(dim * mlp_ratio)
        approx_gelu = lambda: nn.GELU(approximate="tanh")
        self.mlp1 = Mlp(in_features=dim, hidden_features=mlp_hidden_dim, act_layer=approx_gelu, drop=0)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, bias=True))
        self.norm3 = nn.LayerNorm(dim)
        self.cross_attn = nn.MultiheadAttention(dim, heads, dropout, batch_first=True)
        self.norm4 = nn.LayerNorm(dim)
        self.mlp2 = Mlp(in_features=dim, hidden_features=mlp_hidden_dim, act_layer=approx_gelu, drop=0)

    def forward(self, x, cross_c, y, attn_mask, cross_attn_mask=None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(y).chunk(6, dim=2)

        modulated_x = modulate(self.norm1(x), shift_msa, scale_msa)
        x = x + gate_msa * self.attn(modulated_x, modulated_x, modulated_x,
                                     key_padding_mask=attn_mask, need_weights=False)[0]

        modulated_x = modulate(self.norm2(x), shift_mlp, scale_mlp)
        x = x + gate_mlp * self.mlp1(modulated_x)

        if FIXED:
            x = x + self.cross_attn(self.norm3(x), cross_c, cross_c,
                                    key_padding_mask=cross_attn_mask, need_weights=False)[0]
        else:
            x = x + self.cross_attn(self.norm3(x), cross_c, cross_c, need_weights=False)[0]
        x = x + self.mlp2(self.norm4(x))
        return x


class DiT(nn.Module):
    def __init__(self, depth, output_dim, hidden_dim=192, heads=6, dropout=0.1, mlp_ratio=4.0):
        super().__init__()
        T = 81
        D = 4
        self.agent_embedding = nn.Embedding(2, hidden_dim)
        self.preproj = Mlp(in_features=T * D, hidden_features=512, out_features=hidden_dim, act_layer=nn.GELU, drop=0.0)
        self.t_embedder = Mlp(in_features=T, hidden_features=512, out_features=hidden_dim, act_layer=nn.GELU, drop=0.0)
        self.blocks = nn.ModuleList([DiTBlock(hidden_dim, heads, dropout, mlp_ratio) for i in range(depth)])
        self.final_layer = nn.Linear(hidden_dim, output_dim)

    def forward(self, x, t, cross_c, neighbor_current_mask):
        B, P, T, D = x.shape
        x = x.reshape(B, P, T * D)
        t = t.reshape(B, P, T)
        x = self.preproj(x)
        t = self.t_embedder(t)

        x_embedding = torch.cat([self.agent_embedding.weight[0][None, :],
                                 self.agent_embedding.weight[1][None, :].expand(P - 1, -1)], dim=0)
        x = x + x_embedding[None, :, :].expand(B, -1, -1)

        ego_mask = torch.zeros((B, 1), dtype=torch.bool, device=x.device)
        attn_mask = torch.cat([ego_mask, neighbor_current_mask], dim=1)
        if FIXED:
            cross_attn_mask = torch.all(cross_c == 0, dim=-1)
            for block in self.blocks:
                x = block(x, cross_c, t, attn_mask, cross_attn_mask)
        else:
            for block in self.blocks:
                x = block(x, cross_c, t, attn_mask)

        x = self.final_layer(x)
        return x.reshape(B, P, T, D)


if __name__ == "__main__":
    torch.manual_seed(0)
    hidden, heads, token_num, P, T, D = 32, 2, 6, 3, 81, 4
    encoder = Encoder(hidden, heads, 0.1, token_num).eval()
    dit = DiT(depth=1, output_dim=T * D, hidden_dim=hidden, heads=heads).eval()

    # scene tokens: [ego, neighbor, neighbor, lane, lane, route]; True = invalid slot
    encoding_mask = torch.tensor([[False, False, True, True, True, True],
                                  [False, False, False, True, False, False]])
    encoding_input = torch.randn(2, token_num, hidden).masked_fill(encoding_mask[..., None], 0.0)
    neighbor_current_mask = torch.tensor([[False, True], [False, False]])
    x = torch.randn(2, P, T, D)
    t = torch.rand(2, P, T, 1)
    with torch.no_grad():
        cross_c = encoder(encoding_input, encoding_mask)
        out = dit(x, t, cross_c, neighbor_current_mask)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out[0, 0].sum().item():.4f}")
