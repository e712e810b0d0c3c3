# FLAIROx/jafar#3 (commit 0e349d7, "Add causal mask to temporal attention"; reported in FLAIROx/jafar#2): the
# ST-Transformer's temporal attention in the Genie dynamics model had no causal mask, so frame t saw frames > t.
# Upstream is flax; this is the same STBlock / STTransformer / DynamicsMaskGIT written with torch.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32)[:, None]
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x):  # x: (B, T, N, D), encodes the patch index like upstream
        return x + self.pe[: x.shape[2]]


class STBlock(nn.Module):
    def __init__(self, dim, num_heads, dropout):
        super().__init__()
        self.spatial_norm = nn.LayerNorm(dim)
        self.spatial_attn = nn.MultiheadAttention(dim, num_heads, dropout=dropout, batch_first=True)
        self.temporal_norm = nn.LayerNorm(dim)
        self.temporal_attn = nn.MultiheadAttention(dim, num_heads, dropout=dropout, batch_first=True)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Linear(dim, dim)

    def forward(self, x):  # (B, T, N, D)
        B, T, N, D = x.shape
        # --- Spatial attention ---
        z = self.spatial_norm(x).reshape(B * T, N, D)
        z, _ = self.spatial_attn(z, z, z, need_weights=False)
        x = x + z.reshape(B, T, N, D)

        # --- Temporal attention ---
        x = x.swapaxes(1, 2)  # (B, N, T, D)
        z = self.temporal_norm(x).reshape(B * N, T, D)
        if FIXED:
            causal_mask = torch.tril(torch.ones(T, T)).bool()  # jnp.tri(T): True where a key may be seen
            z, _ = self.temporal_attn(z, z, z, attn_mask=~causal_mask, need_weights=False)
        else:
            z, _ = self.temporal_attn(z, z, z, need_weights=False)
        x = x + z.reshape(B, N, T, D)
        x = x.swapaxes(1, 2)

        # --- Feedforward ---
        z = self.ffn_norm(x)
        z = nn.functional.gelu(self.ffn(z))
        return x + z


class STTransformer(nn.Module):
    def __init__(self, in_dim, model_dim, out_dim, num_blocks, num_heads, dropout):
        super().__init__()
        self.stem = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, model_dim), nn.LayerNorm(model_dim))
        self.pos_enc = PositionalEncoding(model_dim)
        self.blocks = nn.ModuleList([STBlock(model_dim, num_heads, dropout) for _ in range(num_blocks)])
        self.out = nn.Linear(model_dim, out_dim)

    def forward(self, x):
        x = self.pos_enc(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)  # (B, T, N, E)


class DynamicsMaskGIT(nn.Module):
    """MaskGIT dynamics model"""

    def __init__(self, model_dim, num_latents, latent_action_dim, num_blocks, num_heads, dropout, mask_limit):
        super().__init__()
        self.mask_limit = mask_limit
        self.dynamics = STTransformer(model_dim, model_dim, num_latents, num_blocks, num_heads, dropout)
        self.patch_embed = nn.Embedding(num_latents, model_dim)
        self.mask_token = nn.Parameter(torch.randn(1, 1, 1, model_dim) * 0.1)
        self.action_up = nn.Linear(latent_action_dim, model_dim)

    def forward(self, batch, training=True):
        # --- Mask videos ---
        vid_embed = self.patch_embed(batch["video_tokens"])
        if training:
            g = batch["mask_rng"]
            mask_prob = self.mask_limit + (1 - self.mask_limit) * torch.rand((), generator=g)
            mask = torch.bernoulli(torch.full(vid_embed.shape[:-1], float(mask_prob)), generator=g).bool()
            mask[:, 0] = False
            vid_embed = torch.where(mask[..., None], self.mask_token, vid_embed)
        else:
            mask = None
        # --- Predict transition ---
        act_embed = self.action_up(batch["latent_actions"])  # (B, T-1, 1, D)
        vid_embed = vid_embed + nn.functional.pad(act_embed, (0, 0, 0, 0, 1, 0))
        logits = self.dynamics(vid_embed)
        return dict(token_logits=logits, mask=mask)


def main():
    torch.manual_seed(0)
    B, T, N, V, A = 2, 6, 9, 32, 4
    model = DynamicsMaskGIT(model_dim=32, num_latents=V, latent_action_dim=A, num_blocks=2, num_heads=4,
                            dropout=0.0, mask_limit=0.5)
    tokens = torch.randint(0, V, (B, T, N))
    actions = torch.randn(B, T - 1, 1, A)
    out = model(dict(video_tokens=tokens, latent_actions=actions, mask_rng=torch.Generator().manual_seed(1)))
    target = tokens
    ce = nn.functional.cross_entropy(out["token_logits"].reshape(-1, V), target.reshape(-1), reduction="none")
    loss = (ce * out["mask"].reshape(-1)).sum() / out["mask"].sum()
    print(f"training loss {loss.item():.4f}")

    # the model is a world model: the prediction for frame 2 must not depend on frames 3.. (the future)
    future = tokens.clone()
    future[:, 3:] = torch.randint(0, V, (B, T - 3, N))
    with torch.no_grad():
        a = model(dict(video_tokens=tokens, latent_actions=actions), training=False)["token_logits"]
        b = model(dict(video_tokens=future, latent_actions=actions), training=False)["token_logits"]
    print("max change of frames 0..2 logits when frames 3.. change:", f"{(a[:, :3] - b[:, :3]).abs().max().item():.4e}")


if __name__ == "__main__":
    main()
