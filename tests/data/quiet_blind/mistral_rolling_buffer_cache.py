"""Mistral sliding-window attention with a rotating (rolling buffer) KV cache.

Follows mistralai/mistral-inference src/mistral_inference/cache.py (formerly mistral-src: RotatingBufferCache,
ModelArgs with sliding_window, cache positions `pos % sliding_window`, unrotate before attention). Prefill: each token sees
itself and the sliding_window-1 tokens before it (causal band). Decode: the cache only ever holds the last
sliding_window keys, so the new token attends to all filled cache slots (in rotated storage order) plus
itself, i.e. a window of sliding_window tokens ending at its own position.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 32
    n_heads: int = 4
    head_dim: int = 8
    sliding_window: int = 4
    vocab_size: int = 40


class RotatingBufferCache:
    def __init__(self, args: ModelArgs, batch_size: int):
        self.sliding_window = args.sliding_window
        self.cache_k = torch.zeros(batch_size, args.sliding_window, args.n_heads, args.head_dim)
        self.cache_v = torch.zeros_like(self.cache_k)
        self.seqlen = 0

    def store(self, xk, xv, positions):
        # only the last sliding_window tokens of a chunk survive; later positions overwrite earlier ones
        keep = positions[-self.sliding_window:]
        self.cache_k[:, keep % self.sliding_window] = xk[:, -len(keep):]
        self.cache_v[:, keep % self.sliding_window] = xv[:, -len(keep):]
        self.seqlen = int(positions[-1]) + 1

    def unrotate(self):
        """Oldest-to-newest keys currently held."""
        n = min(self.seqlen, self.sliding_window)
        if self.seqlen <= self.sliding_window:
            return self.cache_k[:, :n], self.cache_v[:, :n]
        start = self.seqlen % self.sliding_window
        order = torch.cat([torch.arange(start, self.sliding_window), torch.arange(0, start)])
        return self.cache_k[:, order], self.cache_v[:, order]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, positions, cache: RotatingBufferCache):
        bsz, seqlen, _ = x.shape
        a = self.args
        xq = self.wq(x).view(bsz, seqlen, a.n_heads, a.head_dim)
        xk = self.wk(x).view(bsz, seqlen, a.n_heads, a.head_dim)
        xv = self.wv(x).view(bsz, seqlen, a.n_heads, a.head_dim)
        if seqlen > 1:
            # prefill from an empty cache: banded causal mask over the prompt itself
            key, val = xk, xv
            i = positions[:, None]
            j = positions[None, :]
            mask = (j <= i) & (j > i - a.sliding_window)
        else:
            past_k, past_v = cache.unrotate()
            past_k, past_v = past_k[:, -(a.sliding_window - 1):], past_v[:, -(a.sliding_window - 1):]
            key, val = torch.cat([past_k, xk], dim=1), torch.cat([past_v, xv], dim=1)
            mask = torch.ones(1, key.shape[1], dtype=torch.bool)
        cache.store(xk, xv, positions)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2),
                                             attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


def main():
    torch.manual_seed(0)
    args = ModelArgs()
    tok_embeddings, attention = nn.Embedding(args.vocab_size, args.dim), Attention(args)
    output = nn.Linear(args.dim, args.vocab_size, bias=False)
    cache = RotatingBufferCache(args, batch_size=1)
    prompt = torch.randint(0, args.vocab_size, (1, 10))
    generated = []
    with torch.no_grad():
        positions = torch.arange(prompt.shape[1])
        h = attention(tok_embeddings(prompt), positions, cache)
        next_token = output(h[:, -1]).argmax(-1)
        for _ in range(5):
            generated.append(int(next_token))
            positions = torch.tensor([cache.seqlen])
            h = attention(tok_embeddings(next_token[:, None]), positions, cache)
            next_token = output(h[:, -1]).argmax(-1)
    print(generated)


if __name__ == "__main__":
    main()
