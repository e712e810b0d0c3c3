"""A decoder that caches its keys unrotated and rotates the whole cache again at every step (as RoFormer-style and
keras-style rotary layers do when they re-rotate), its rotary angles laid out interleaved (GPT-J's pairs 2d, 2d+1).

Bug: the step rotates its new query at the cache's length taken *after* the new key was appended, one position past
its own key, so every step's query sits one token after itself and reads its own key as the one before it. Fixed (--fixed): the query rotated at the position its key was stored at (the cache's length before the
append). The output differs silently; the mask (a causal mask over the cache, query at its own slot) is right in both.
"""

import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)

DIM, HEADS, LAYERS, VOCAB = 32, 2, 2, 50
HEAD = DIM // HEADS


def angles(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (500.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD))
    theta = positions.float()[:, None] * inv[None, :]
    theta = torch.repeat_interleave(theta, 2, dim=-1)  # (L, HEAD): pairs 2d, 2d+1 share an angle
    return torch.cos(theta)[None, None], torch.sin(theta)[None, None]


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = angles(positions)
    return x * cos + rotate_pairs(x) * sin


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x, cache, start):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        total = k.shape[2]
        keys = rotate(k, torch.arange(total))
        first = start if FIXED or cache is None else total
        query = rotate(q, torch.arange(first, first + s))
        rows = torch.arange(start, start + s)[:, None]
        mask = rows >= torch.arange(total)[None, :]
        y = torch.nn.functional.scaled_dot_product_attention(query, keys, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, DIM)), (k, v)


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids, caches, start):
        x = self.embed(ids)
        new = []
        for layer, cache in zip(self.layers, caches):
            x, kept = layer(x, cache, start)
            new.append(kept)
        return self.head(x), new


@torch.no_grad()
def generate(model, prompt, steps):
    logits, caches = model(prompt, [None] * LAYERS, 0)
    out = prompt
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, token], dim=1)
        logits, caches = model(token, caches, out.shape[1] - 1)
    return out


model = Decoder().eval()
prompt = torch.tensor([[1, 7, 3, 9, 4]])
logits, caches = model(prompt, [None] * LAYERS, 0)
with torch.no_grad():
    step, _ = model(torch.tensor([[11]]), caches, prompt.shape[1])
print(generate(model, prompt, 5).tolist(), f"{float(step.abs().sum()):.4f}")
