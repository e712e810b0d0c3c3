# Written another way than FastVideo #1307 (tests/data/bugs/fastvideo_longcat_dfsft_trains_without_block_causal_mask.py):
# a Self-Forcing style causal Wan DiT that keeps its own `num_frame_per_block` and builds its block-causal training
# mask itself as a boolean (B, 1, L, L) SDPA mask over a batch of two latents laid out [B, C, T, H, W] and patched
# 2x2. The buggy mask compares each key's *frame* index with the end of the query's block counted in *tokens*
# (block end x frame_seqlen), so the first block's queries see frames of later blocks; the fix compares frames with
# frames.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def block_causal_mask(num_frames, frame_seqlen, num_frame_per_block, batch):
    token = torch.arange(num_frames * frame_seqlen)
    frame = token // frame_seqlen
    block_end = (frame // num_frame_per_block + 1) * num_frame_per_block  # in frames
    if FIXED:
        visible = frame[None, :] < block_end[:, None]
    else:
        visible = frame[None, :] < (block_end * frame_seqlen)[:, None]  # frames against tokens
    return visible[None, None].expand(batch, 1, -1, -1)


class CausalWanAttentionBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask):
        B, L, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.o(out.transpose(1, 2).reshape(B, L, C))


class CausalWanModel(nn.Module):
    def __init__(self, in_dim=4, dim=16, heads=2, layers=2, patch=2):
        super().__init__()
        self.patch = patch
        self.num_frame_per_block = 1
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=(1, patch, patch), stride=(1, patch, patch))
        self.blocks = nn.ModuleList([CausalWanAttentionBlock(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, in_dim * patch * patch)

    def forward(self, latents, timestep):
        B, C, T, H, W = latents.shape
        x = self.patch_embedding(latents).flatten(2).transpose(1, 2)  # [B, T*(H/p)*(W/p), dim]
        x = x + timestep.view(B, 1, 1) / 1000.0
        frame_seqlen = (H // self.patch) * (W // self.patch)
        mask = block_causal_mask(T, frame_seqlen, self.num_frame_per_block, B)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


model = CausalWanModel()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
latents = torch.randn(2, 4, 6, 4, 4)  # [B, C, T=6 latent frames, H, W]: 4 tokens a frame after 2x2 patches
for step in range(2):
    t = torch.rand(2) * 1000
    noise = torch.randn_like(latents)
    pred = model(latents + noise, t)
    loss = pred.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
