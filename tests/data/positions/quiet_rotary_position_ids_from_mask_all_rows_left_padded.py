"""A correct decode loop the rotary reading must stay quiet on: every row left-padded (by 1 and by 3), positions from
`attention_mask.cumsum(-1) - 1` (each row's real tokens from 0), a transformers-style rotary module (an `inv_freq`
buffer, `forward(x, position_ids)` giving one (cos, sin) row per batch row and token), SDPA with a boolean mask over
a cache grown by torch.cat. A decode query of row 1 sees its real keys only, as many as its position + 1: its table's
largest position is that count's, not the cache's length.
"""
import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"hidden": 32, "heads": 2, "layers": 2, "vocab": 40, "rope_theta": 10000.0}


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads, self.dim = cfg["heads"], cfg["hidden"] // cfg["heads"]
        self.qkv = nn.Linear(cfg["hidden"], 3 * cfg["hidden"], bias=False)
        self.o = nn.Linear(cfg["hidden"], cfg["hidden"], bias=False)

    def forward(self, x, position_embeddings, mask, past):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1)), (k, v)


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.rotary = RotaryEmbedding(cfg["hidden"] // cfg["heads"], cfg["rope_theta"])
        self.layers = nn.ModuleList([SelfAttention(cfg) for _ in range(cfg["layers"])])
        self.head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        t, total = input_ids.shape[1], attention_mask.shape[1]
        x = self.embed(input_ids)
        position_embeddings = self.rotary(x, position_ids)
        causal = torch.ones(t, total, dtype=torch.bool).tril(total - t)
        own = torch.arange(total)[None, :] == torch.arange(total - t, total)[:, None]
        mask = ((causal[None] & attention_mask.bool()[:, None, :]) | own[None])[:, None]
        cache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, position_embeddings, mask, None if past_key_values is None else past_key_values[i])
            cache.append(kv)
        return self.head(x[:, -1]), cache


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = Decoder(CONFIG).eval()
    ids = torch.tensor([[0, 5, 6, 7, 8, 9], [0, 0, 0, 11, 12, 13]])
    attention_mask = (ids != 0).long()
    past = None
    step_ids = ids
    for _ in range(4):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        logits, past = model(step_ids, attention_mask, position_ids, past)
        step_ids = logits.argmax(-1, keepdim=True)
        attention_mask = torch.cat([attention_mask, torch.ones_like(step_ids)], dim=1)
    print(step_ids.tolist())


if __name__ == "__main__":
    main()
