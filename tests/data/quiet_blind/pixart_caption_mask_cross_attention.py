"""PixArt-alpha (PixArt-alpha/PixArt-alpha) DiT block: image tokens cross-attend to a masked T5 caption.

Follows diffusion/model/nets/PixArt.py (PixArt.forward: `y = y.squeeze(1).masked_select(mask...)`,
`y_lens = mask.sum(dim=1)`) and diffusion/model/nets/PixArt_blocks.py (MultiHeadCrossAttention:
xformers BlockDiagonalMask.from_seqlens([N] * B, y_lens)). The captions of a batch are packed into
one key sequence with their real lengths; each image's N latent patch tokens (here 64, far more than
the <= 12 caption tokens) attend to ONLY their own caption's real tokens. Written here with the
same block-diagonal mask built as a bool tensor for F.scaled_dot_product_attention (the CPU
replacement for xformers.ops.memory_efficient_attention). Self-attention over patches is unmasked.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, cond, mask=None):
        # x: (B, N, C) image tokens; cond: (1, sum(y_lens), C) packed caption tokens
        B, N, C = x.shape
        q = self.q_linear(x).view(1, -1, self.num_heads, self.head_dim)
        kv = self.kv_linear(cond).view(1, -1, 2, self.num_heads, self.head_dim)
        k, v = kv.unbind(2)
        attn_bias = None
        if mask is not None:
            # BlockDiagonalMask.from_seqlens(q_seqlen=[N] * B, kv_seqlen=mask)
            q_seg = torch.repeat_interleave(torch.arange(len(mask)), torch.tensor([N] * len(mask)))
            kv_seg = torch.repeat_interleave(torch.arange(len(mask)), torch.tensor(mask))
            attn_bias = q_seg[:, None] == kv_seg[None, :]
        x = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_bias)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class PixArtBlock(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(hidden_size, num_heads, batch_first=True)
        self.cross_attn = MultiHeadCrossAttention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, hidden_size * 4), nn.GELU(approximate="tanh"), nn.Linear(hidden_size * 4, hidden_size))
        self.scale_shift_table = nn.Parameter(torch.randn(6, hidden_size) / hidden_size ** 0.5)

    def forward(self, x, y, t, mask=None):
        B, N, C = x.shape
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (self.scale_shift_table[None] + t.reshape(B, 6, -1)).chunk(6, dim=1)
        h = self.norm1(x) * (1 + scale_msa) + shift_msa
        x = x + gate_msa * self.attn(h, h, h, need_weights=False)[0]
        x = x + self.cross_attn(x, y, mask)
        x = x + gate_mlp * self.mlp(self.norm2(x) * (1 + scale_mlp) + shift_mlp)
        return x


class PixArt(nn.Module):
    def __init__(self, input_size=16, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4, caption_channels=48):
        super().__init__()
        self.x_embedder = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        self.t_embedder = nn.Sequential(nn.Linear(1, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.y_embedder = nn.Sequential(nn.Linear(caption_channels, hidden_size), nn.GELU(approximate="tanh"), nn.Linear(hidden_size, hidden_size))
        self.blocks = nn.ModuleList([PixArtBlock(hidden_size, num_heads) for _ in range(depth)])
        self.final = nn.Linear(hidden_size, patch_size * patch_size * in_channels)

    def forward(self, x, timestep, y, mask=None):
        x = self.x_embedder(x).flatten(2).transpose(1, 2)  # (B, N, C)
        t = self.t_embedder(timestep[:, None].float())
        t0 = self.t_block(t)
        y = self.y_embedder(y)  # (B, 1, L, C)
        if mask is not None:
            if mask.shape[0] != y.shape[0]:
                mask = mask.repeat(y.shape[0] // mask.shape[0], 1)
            mask = mask.squeeze(1).squeeze(1)
            y = y.squeeze(1).masked_select(mask.unsqueeze(-1) != 0).view(1, -1, x.shape[-1])
            y_lens = mask.sum(dim=1).tolist()
        else:
            y_lens = [y.shape[2]] * y.shape[0]
            y = y.squeeze(1).view(1, -1, x.shape[-1])
        for block in self.blocks:
            x = block(x, y, t0, y_lens)
        return self.final(x)


def main():
    torch.manual_seed(0)
    model = PixArt().eval()
    B, max_len = 3, 12
    caption_embs = torch.randn(B, 1, max_len, 48)  # T5 encoder output, padded to model_max_length
    emb_masks = torch.zeros(B, max_len, dtype=torch.long)
    for b, n in enumerate((12, 5, 8)):
        emb_masks[b, :n] = 1  # tokenizer attention_mask
    latents = torch.randn(B, 4, 16, 16)
    with torch.no_grad():
        eps = model(latents, torch.tensor([999, 500, 10]), caption_embs, mask=emb_masks)
    print("noise prediction", tuple(eps.shape), f"{eps.std().item():.4f}")


if __name__ == "__main__":
    main()
