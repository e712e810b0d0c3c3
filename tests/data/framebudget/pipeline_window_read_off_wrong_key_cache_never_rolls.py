# The same bug as FastVideo#1355 (hao-ai-lab/FastVideo, commit 63030cf), written another way: a Self-Forcing style
# inference pipeline sizes the per-layer KV caches itself and reads the rolling window from its YAML-like dict under a
# key the config does not have (`local_attn_frames`), falling back to -1. Every attention layer states
# local_attn_size = 3 (no sink), but the cache holds the whole video and never rolls: each block attends every earlier
# frame. Hand-written softmax attention over a heads-first (B, H, L, D) cache, batch of 3. The fix asks the model.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

DIM, HEADS, FRAMES_PER_BLOCK, NUM_FRAMES = 24, 3, 1, 6
HEAD_DIM = DIM // HEADS


class RollingSelfAttention(nn.Module):
    def __init__(self, local_attn_size):
        super().__init__()
        self.local_attn_size = local_attn_size
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x, cache, start):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        end = cache["end"]
        size = cache["k"].shape[2]
        if end + L > size:  # roll: drop the oldest frames, keep the latest behind the new block
            keep = size - L
            cache["k"][:, :, :keep] = cache["k"][:, :, end - keep:end].clone()
            cache["v"][:, :, :keep] = cache["v"][:, :, end - keep:end].clone()
            end = keep
        cache["k"][:, :, end:end + L] = k
        cache["v"][:, :, end:end + L] = v
        cache["end"] = end + L
        keys, values = cache["k"][:, :, :end + L], cache["v"][:, :, :end + L]
        weights = torch.softmax(q @ keys.transpose(-1, -2) / HEAD_DIM ** 0.5, dim=-1)
        return self.out((weights @ values).transpose(1, 2).reshape(B, L, DIM))


class VideoGenerator(nn.Module):
    def __init__(self, local_attn_size=3, depth=2):
        super().__init__()
        self.local_attn_size = local_attn_size
        self.layers = nn.ModuleList([RollingSelfAttention(local_attn_size) for _ in range(depth)])

    def forward(self, x, caches, start):
        for layer, cache in zip(self.layers, caches):
            x = x + layer(x, cache, start)
        return x


class InferencePipeline:
    def __init__(self, generator, args, tokens_per_frame):
        self.generator = generator
        self.tokens_per_frame = tokens_per_frame
        if FIXED:
            self.local_attn_size = generator.local_attn_size
        else:
            self.local_attn_size = args.get("local_attn_frames", -1)

    def make_caches(self, batch):
        frames = NUM_FRAMES if self.local_attn_size == -1 else self.local_attn_size
        shape = (batch, HEADS, frames * self.tokens_per_frame, HEAD_DIM)
        return [{"k": torch.zeros(shape), "v": torch.zeros(shape), "end": 0} for _ in self.generator.layers]

    @torch.no_grad()
    def generate(self, noise):
        caches = self.make_caches(noise.shape[0])
        out = []
        for block in range(NUM_FRAMES // FRAMES_PER_BLOCK):
            n = FRAMES_PER_BLOCK * self.tokens_per_frame
            x = noise[:, block * n:(block + 1) * n]
            out.append(self.generator(x, caches, block * n))
        return torch.cat(out, 1)


args = {"num_frames": NUM_FRAMES, "local_attn_size": 3}
pipeline = InferencePipeline(VideoGenerator(), args, tokens_per_frame=4)
video = pipeline.generate(torch.randn(3, NUM_FRAMES * 4, DIM))
print(f"pipeline local_attn_size={pipeline.local_attn_size}; video {tuple(video.shape)}")
