# The fms pad_input_ids bug (foundation-model-stack 32bfbc8, pads flagged by the pad value) written another way: a
# hand-rolled batched-generation helper for a RoPE decoder (a llama-style toy) left-pads its prompts with the
# tokenizer's pad id (here 2, the EOS, as many code models pad with) and gives the pads position 1 as Hugging Face's
# `cumsum - 1` fill does, but builds the boolean SDPA mask from `ids != 0`, the pad id it assumed: every pad is kept
# and the short prompt's real tokens attend them. The fix builds the keep mask from each prompt's length.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 2


def rope(x, positions):
    half = x.shape[-1] // 2
    freqs = positions[:, None, :, None].float() / (10000 ** (torch.arange(half) / half))
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, keep, positions):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rope(q, positions), rope(k, positions)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.out(y.transpose(1, 2).reshape(b, s, d))


class Decoder(nn.Module):
    def __init__(self, vocab=40, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])

    def forward(self, input_ids, keep, position_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, keep, position_ids)
        return x @ self.embed.weight.t()


def batch(prompts):
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    columns = torch.arange(width)[None, :]
    real = columns >= (width - lengths)[:, None]
    positions = (columns - (width - lengths)[:, None]).masked_fill(~real, 1)
    flags = real if FIXED else tokens != 0  # the pad id taken for 0
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    keep = causal[None, None] & flags[:, None, None, :]
    keep = keep | torch.eye(width, dtype=torch.bool)[None, None]  # (a pad row keeps itself: no NaN)
    return tokens, keep, positions


model = Decoder().eval()
prompts = [[5, 9, 13, 21], [7, 8, 11, 30, 31, 17, 25, 19, 6]]
with torch.no_grad():
    tokens, keep, positions = batch(prompts)
    batched = model(tokens, keep, positions)[0, -1]
    tokens1, keep1, positions1 = batch(prompts[:1])
    alone = model(tokens1, keep1, positions1)[0, -1]
print(f"max |logits(short prompt in a left-padded batch) - logits(alone)| = {(batched - alone).abs().max().item():.6f}")
