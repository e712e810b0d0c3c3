# The bug of SpecForge#424 written as a HASS/EAGLE-style draft trainer of another project would: multi-step draft
# training (training-time test), config kept as a dict, a rotary module that rotates q and k itself (inv_freq @
# positions, its cos/sin never held by the attention's frame), right-padded rows, and SDPA over the keys of every step laid block after block
# (step 0's causal block, then each later step's block seen on its diagonal: a token sees its own earlier drafts).
# Step s's queries stand for the tokens s places further on, so they must be rotated at position_ids + s (the steps
# cached); the bug rotates every step at position_ids, the fix adds the steps cached.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 10000.0, "ttt_length": 3, "vocab_size": 96}


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rotate(self, q, k, position_ids):
        return apply_rotary(q, k, *self(q, position_ids))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def step_mask(real, steps):
    """Bool (B, 1, L, L * steps): step 0's keys causal over the real tokens, each later step's real keys on the
    diagonal."""
    length = real.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    own = torch.eye(length, dtype=torch.bool)
    first = causal[None] & real[:, None, :]
    later = own[None] & real[:, None, :]
    return torch.cat([first] + [later] * (steps - 1), dim=-1)[:, None]


class DraftAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config["num_attention_heads"]
        self.head_dim = config["hidden_size"] // self.heads
        self.qkv = nn.Linear(config["hidden_size"], 3 * config["hidden_size"], bias=False)
        self.out = nn.Linear(config["hidden_size"], config["hidden_size"], bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, config["rope_theta"])

    def forward(self, x, position_ids, real, cache):
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cached = len(cache)  # the steps whose keys are cached already
        q, k = self.rotary.rotate(q, k, position_ids + cached if FIXED else position_ids)
        cache.append((k, v))
        keys = torch.cat([kk for kk, _ in cache], dim=2)
        values = torch.cat([vv for _, vv in cache], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=step_mask(real, len(cache)))
        return self.out(out.transpose(1, 2).reshape(batch, length, -1))


class Draft(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.attn = DraftAttention(config)
        self.head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)

    def forward(self, input_ids, attention_mask, hidden):
        real = attention_mask.bool()
        position_ids = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        cache, losses = [], []
        for step in range(self.config["ttt_length"]):
            hidden = hidden + self.attn(hidden + self.embed(input_ids), position_ids, real, cache)
            logits = self.head(hidden)
            target = torch.roll(input_ids, -(step + 1), dims=1)
            losses.append(F.cross_entropy(logits[real], target[real]))
            input_ids = torch.roll(input_ids, -1, dims=1)
        return losses


def main():
    torch.manual_seed(0)
    model = Draft(CONFIG)
    batch, length = 2, 12
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, 9:] = 0  # right padding
    input_ids = torch.randint(1, CONFIG["vocab_size"], (batch, length)) * attention_mask
    hidden = torch.randn(batch, length, CONFIG["hidden_size"])
    losses = model(input_ids, attention_mask, hidden)
    total = sum(0.8 ** i * loss for i, loss in enumerate(losses))
    total.backward()
    print("draft losses", " ".join(f"{x.item():.4f}" for x in losses))


if __name__ == "__main__":
    main()
