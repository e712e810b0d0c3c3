"""A decoder whose image tokens share one rotary position (CogVLM's scheme: the whole image at the position after BOS),
decoding with a KV cache: the model call is handed position_ids, so a decode step's query sits at a position smaller
than the keys it sees, and its rotary table holds rows up to that position. `--table-for-step`: the table built for
the step's own token only (every cached step rotated at position 0, lag-llama 4a2d099's slip), a position the model
call states past it."""

import sys

import torch
import torch.nn.functional as F

FOR_STEP = "--table-for-step" in sys.argv


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, length):
        angles = torch.outer(torch.arange(length).float(), self.inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos(), emb.sin()


class Attention(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.rotary = Rotary(dim // heads)

    def forward(self, x, position_ids, cache):
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        rows = l if FOR_STEP and cache else int(position_ids.max()) + 1
        cos, sin = self.rotary(rows)
        at = position_ids.clamp(max=rows - 1) if FOR_STEP and cache else position_ids
        cos, sin = cos[at][:, None], sin[at][:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=l > 1)
        return x + out.transpose(1, 2).reshape(b, l, d)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(Attention() for _ in range(2))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, input_ids, position_ids, caches):
        x = self.embed(input_ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, position_ids, cache)
        return self.head(x)


torch.manual_seed(0)
model = Model().eval()
ids = torch.tensor([[1, 30, 30, 30, 30, 30, 5, 6, 7]])  # BOS, a 5-token image (id 30), then text
image = ids == 30
positions = torch.cumsum(~image | F.pad(image, (1, 0))[:, :-1].logical_not() & image, dim=1) - 1
caches = [[] for _ in model.layers]
with torch.no_grad():
    logits = model(ids, positions, caches)
    for _ in range(3):
        token = logits[:, -1:].argmax(-1)
        positions = positions[:, -1:] + 1
        logits = model(token, positions, caches)
print("positions of the prompt and the last step:", positions.tolist(), "logit sum:", round(logits.sum().item(), 4))
