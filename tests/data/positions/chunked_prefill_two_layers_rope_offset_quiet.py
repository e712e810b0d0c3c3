# A correct program of the shape positions-vs-keys' step-to-step reading of rotary factors looks at: two decoder
# layers (one attention class, so one call site), a prompt fed in equal chunks of 4 over a growing KV cache, then
# decode steps of one token. Each chunk's queries see the cache's keys and their own, 4 more each time, and are rotated
# 4 positions further on (transformers' style: cos/sin of position_ids, the table never held by the attention's frame).
# Quiet: every step that grew the cache moved its positions by as much. (--fixed runs the same program.)
import torch
import torch.nn as nn
import torch.nn.functional as F


class Rotary(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def rotate(self, q, k, positions):
        freqs = positions[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]

        def half(x):
            return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

        return q * cos + half(q) * sin, k * cos + half(k) * sin


class Layer(nn.Module):
    def __init__(self, width=32, heads=2):
        super().__init__()
        self.heads, self.dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.rotary = Rotary(self.dim)

    def forward(self, x, positions, cache):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        q, k = self.rotary.rotate(q, k, positions)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        past = k.shape[2] - t
        mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(past)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + out.transpose(1, 2).reshape(b, t, -1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x, position_ids, caches):
        for layer, cache in zip(self.layers, caches):
            x = layer(x, position_ids, cache)
        return x


def main():
    torch.manual_seed(0)
    model = Model().eval()
    prompt = torch.randn(2, 12, 32)
    caches = [[], []]
    with torch.no_grad():
        for start in range(0, 12, 4):
            x = model(prompt[:, start:start + 4], torch.arange(start, start + 4)[None].expand(2, 4), caches)
        for step in range(3):
            x = model(x[:, -1:], torch.full((2, 1), 12 + step), caches)
    print("out", float(x.sum()))


if __name__ == "__main__":
    main()
