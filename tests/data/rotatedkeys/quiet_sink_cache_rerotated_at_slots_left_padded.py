"""Correct: a StreamingLLM-style decoder that keeps 2 attention-sink tokens and the last 4 tokens, caches its keys
unrotated, and rotates the whole cache again at every step at the keys' slots in the cache (0..N-1), the step's query
at its own slot (N-1), as the paper's position shift does. A batch of two prompts, the shorter left-padded: the padding
keys are masked in every step, and each row's rotary positions count its real tokens from its first.
"""

import torch

torch.manual_seed(5)
DIM, HEADS, VOCAB, SINKS, RECENT = 32, 2, 40, 2, 4
HEAD = DIM // HEADS


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate(x, positions):
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, L, HEAD)
    return x * emb.cos() + rotate_half(x) * emb.sin()


class SinkAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x, cache, keep):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            keep = torch.cat([cache[2], keep], dim=1)
        if k.shape[2] > SINKS + RECENT:  # evict the middle: the sinks and the recent tokens stay
            k = torch.cat([k[:, :, :SINKS], k[:, :, -RECENT:]], dim=2)
            v = torch.cat([v[:, :, :SINKS], v[:, :, -RECENT:]], dim=2)
            keep = torch.cat([keep[:, :SINKS], keep[:, -RECENT:]], dim=1)
        n = k.shape[2]
        slots = (keep.long().cumsum(-1) - 1).clamp(min=0)  # each row's real keys numbered from its first
        keys = rotate(k, slots)
        query = rotate(q, slots[:, n - s:])
        causal = torch.ones(s, n, dtype=torch.bool).tril(n - s)
        mask = causal[None, None] & keep[:, None, None, :]
        y = torch.nn.functional.scaled_dot_product_attention(query, keys, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, DIM)), (k, v, keep)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.attn = torch.nn.ModuleList(SinkAttention() for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids, keep, caches):
        x, new = self.embed(ids), []
        for layer, cache in zip(self.attn, caches):
            h, c = layer(x, cache, keep)
            x = x + h
            new.append(c)
        return self.head(x), new


@torch.no_grad()
def main():
    model = Model().eval()
    ids = torch.tensor([[0, 0, 5, 9, 2], [3, 8, 1, 7, 6]])
    keep = torch.tensor([[False, False, True, True, True], [True] * 5])
    logits, caches = model(ids, keep, [None, None])
    tokens = []
    for _ in range(6):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        logits, caches = model(token, torch.ones(2, 1, dtype=torch.bool), caches)
    print(torch.cat(tokens, dim=1).tolist())


main()
