# The same bug as LAION-AI/temporal-embedding-aggregation#14, written another way: a Perceiver-style latent pooler
# (SDPA, heads split by a reshape, config kept as a dict) over per-frame features of clips LEFT-padded with zero
# frames to a common length, with two learned register tokens APPENDED to the memory. Before the fix no mask reaches
# the cross-attention, so the latents of the short clips attend to their zero frames; the fix hands SDPA a boolean
# key mask built from the frames that are zero in every channel (the registers always kept).
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CONFIG = {"dim": 32, "heads": 4, "num_latents": 3, "num_registers": 2, "max_frames": 12, "classes": 5}


class LatentPooler(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg["heads"]
        self.q = nn.Linear(cfg["dim"], cfg["dim"])
        self.kv = nn.Linear(cfg["dim"], 2 * cfg["dim"])
        self.out = nn.Linear(cfg["dim"], cfg["dim"])

    def forward(self, latents, memory, key_keep=None):
        b, n, d = latents.shape
        m = memory.shape[1]
        q = self.q(latents).reshape(b, n, self.heads, d // self.heads).transpose(1, 2)
        k, v = self.kv(memory).chunk(2, dim=-1)
        k = k.reshape(b, m, self.heads, d // self.heads).transpose(1, 2)
        v = v.reshape(b, m, self.heads, d // self.heads).transpose(1, 2)
        mask = None if key_keep is None else key_keep[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, n, d))


class ClipClassifier(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(cfg["num_latents"], cfg["dim"]))
        self.registers = nn.Parameter(torch.randn(cfg["num_registers"], cfg["dim"]))
        self.frame_proj = nn.Linear(cfg["dim"], cfg["dim"])
        self.pool = LatentPooler(cfg)
        self.head = nn.Linear(cfg["dim"], cfg["classes"])

    def forward(self, frames):
        b = frames.shape[0]
        memory = torch.cat([self.frame_proj(frames), self.registers.expand(b, -1, -1)], dim=1)
        key_keep = None
        if FIXED:
            real = frames.abs().sum(-1) != 0  # frames zero in every channel are the padding
            key_keep = torch.cat([real, torch.ones(b, self.registers.shape[0], dtype=torch.bool)], dim=1)
        pooled = self.pool(self.latents.expand(b, -1, -1), memory, key_keep)
        return self.head(pooled.mean(1))


model = ClipClassifier(CONFIG).eval()
lengths = [5, 12, 8]  # frames per clip, left-padded with zero frames to max_frames
frames = torch.zeros(len(lengths), CONFIG["max_frames"], CONFIG["dim"])
for i, n in enumerate(lengths):
    frames[i, CONFIG["max_frames"] - n:] = torch.randn(n, CONFIG["dim"])
with torch.no_grad():
    logits = model(frames)
print("pred", logits.argmax(-1).tolist())
