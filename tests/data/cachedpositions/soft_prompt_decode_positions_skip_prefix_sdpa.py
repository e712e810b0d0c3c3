"""A decoder-only LM conditioned on a soft prompt (a few learned prefix embeddings before the text), generating with a
hand-kept KV cache (cache first, then the step's own key), SDPA with a boolean mask over a left-padded batch and
rotary positions counted inside the model from a start (GPT-2's past_length + arange). The prompt pass numbers every
real token, prefix included (from minus its row's pads); the buggy decode
loop numbers the new token from the text's length alone, as if the soft prompt held no positions, so each new token
sits `num_prefix_tokens` places back, among the cached prompt's positions. The fix counts the whole prompt."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
CONFIG = {"hidden": 32, "heads": 4, "layers": 2, "vocab": 50, "num_prefix_tokens": 6, "rope_theta": 10000.0}


def rotate(x, positions, theta):
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions[:, None, :, None].float() * freqs  # (B, 1, L, half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg, self.heads = cfg, cfg["heads"]
        self.qkv = nn.Linear(cfg["hidden"], 3 * cfg["hidden"])
        self.proj = nn.Linear(cfg["hidden"], cfg["hidden"])

    def forward(self, x, positions, keep, cache):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, positions, self.cfg["rope_theta"]), rotate(k, positions, self.cfg["rope_theta"])
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


class SoftPromptLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.prefix = nn.Parameter(torch.randn(cfg["num_prefix_tokens"], cfg["hidden"]))
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.blocks = nn.ModuleList(Attention(cfg) for _ in range(cfg["layers"]))
        self.head = nn.Linear(cfg["hidden"], cfg["vocab"])

    def forward(self, x, start, keep, caches):
        positions = start + torch.arange(x.shape[1])  # (GPT-2's past_length + arange; the pads before 0)
        for block, cache in zip(self.blocks, caches):
            x = x + block(x, positions, keep, cache)
        return self.head(x)


@torch.no_grad()
def generate(model, text, text_mask, new_tokens=3):
    cfg, batch = model.cfg, text.shape[0]
    prefix = model.prefix[None].expand(batch, -1, -1)
    # left padding: [pads | soft prompt | text]; the pads come before the soft prompt in each row
    pads = (~text_mask).sum(-1)
    length = cfg["num_prefix_tokens"] + text.shape[1]
    n = cfg["num_prefix_tokens"]
    order = torch.stack([torch.cat([torch.arange(n, n + p), torch.arange(n), torch.arange(n + p, length)])
                         for p in pads.tolist()])  # each row's text pads moved before its soft prompt
    embeds = torch.cat([prefix, model.embed(text)], dim=1).gather(1, order[..., None].expand(-1, -1, cfg["hidden"]))
    mask = torch.cat([torch.ones(batch, cfg["num_prefix_tokens"], dtype=torch.bool), text_mask], dim=1).gather(1, order)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool))[None] & mask[:, None, :]
    keep = keep | torch.eye(length, dtype=torch.bool)[None]  # (a pad row sees itself)
    caches = [[] for _ in model.blocks]
    logits = model(embeds, -pads[:, None], keep, caches)  # (the pads before position 0)
    out = []
    for step in range(new_tokens):
        token = logits[:, -1].argmax(-1)
        out.append(token)
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.bool)], dim=1)
        if FIXED:
            start = mask[:, :-1].sum(-1)  # every real token of the prompt and those generated since
        else:
            start = text_mask.sum(-1) + step  # the text's tokens alone: the soft prompt's positions forgotten
        logits = model(model.embed(token)[:, None], start[:, None], mask[:, None, :], caches)
    return torch.stack(out, dim=1)


def main():
    torch.manual_seed(0)
    model = SoftPromptLM(CONFIG).eval()
    text = torch.randint(1, CONFIG["vocab"], (3, 7))
    text_mask = torch.arange(7)[None, :] >= torch.tensor([0, 3, 5])[:, None]  # left-padded texts of 7, 4, 2
    print(generate(model, text, text_mask).tolist())


if __name__ == "__main__":
    main()
