# Correct decoding that cache-tokens-skipped must leave alone: (1) a decoder handed the whole sequence so far whose
# per-layer cache keeps the last 4 keys (a sliding window: past the window the keys stop growing while the ids grow);
# (2) the same model called transformers-style, each step handed its new token alone behind the full cache (the ids
# do not extend the step before's); (3) a speculative step that runs 3 drafted tokens at once (the ids grow by the
# step's 3 queries). SDPA, a batch of two.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
WINDOW = 4


class Layer(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, kv, window):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        if kv:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        seen = torch.ones(t, k.shape[2], dtype=torch.bool).tril(k.shape[2] - t)
        if window:
            seen &= ~torch.ones_like(seen).tril(k.shape[2] - t - window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        kv[:] = [k[:, :, -window:], v[:, :, -window:]] if window else [k, v]
        return x + out.transpose(1, 2).reshape(b, t, d)


class Model(nn.Module):
    def __init__(self, vocab=30, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layer = Layer(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, kv, new=1, window=0):
        x = self.emb(tokens[:, -new:] if kv else tokens)
        return self.head(self.layer(x, kv, window))[:, -1]


@torch.no_grad()
def main():
    model = Model().eval()
    # (1) the whole prefix each step, a windowed cache
    ids, kv = torch.randint(0, 30, (2, 3)), []
    logits = model(ids, kv, window=WINDOW)
    for _ in range(5):
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        logits = model(ids, kv, window=WINDOW)
    # (2) new tokens alone, a full cache
    ids, kv = torch.randint(0, 30, (2, 3)), []
    logits = model(ids, kv)
    for _ in range(3):
        nxt = logits.argmax(-1, keepdim=True)
        logits = model(nxt, kv)
    # (3) the whole prefix, three drafted tokens run at once
    ids, kv = torch.randint(0, 30, (2, 3)), []
    model(ids, kv)
    ids = torch.cat([ids, torch.randint(0, 30, (2, 3))], 1)
    print(model(ids, kv, new=3).shape)


main()
