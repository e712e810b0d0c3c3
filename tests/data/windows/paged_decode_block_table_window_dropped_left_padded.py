# A Mistral-style model (every layer sliding: ModelArgs.sliding_window, a dataclass of its own) served from a paged KV
# cache (block tables, 4 slots a block). Prefill runs one request at a time through SDPA with a bool keep mask that
# holds the window. Decode batches the requests: each one's keys are gathered out of the cache through its block
# table into a left-padded (B, max_len, H, D) buffer and scored with einsum("bhd,bnhd->bhn"), one query per head; the
# decode metadata masks the padding only, so the window the prefill had is gone at decode (every cached key seen).
# --fixed: the decode mask also keeps only the last sliding_window keys of each request.
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
BLOCK = 4


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 64
    sliding_window: int = 5


class PagedCache:
    def __init__(self, args, num_blocks):
        shape = (num_blocks, BLOCK, args.n_heads, args.head_dim)
        self.k = [torch.zeros(shape) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape) for _ in range(args.n_layers)]

    def write(self, layer, slots, k, v):
        self.k[layer].view(-1, *self.k[layer].shape[2:])[slots] = k
        self.v[layer].view(-1, *self.v[layer].shape[2:])[slots] = v

    def gather_left_padded(self, layer, block_tables, seq_lens):
        """(B, max_len, H, D) keys and values of each request, its own at the end of its row."""
        n = int(seq_lens.max())
        k = torch.zeros(len(seq_lens), n, *self.k[layer].shape[2:])
        v = torch.zeros_like(k)
        flat_k = self.k[layer].view(-1, *self.k[layer].shape[2:])
        flat_v = self.v[layer].view(-1, *self.v[layer].shape[2:])
        for b, length in enumerate(seq_lens.tolist()):
            pos = torch.arange(length)
            slots = block_tables[b, pos // BLOCK] * BLOCK + pos % BLOCK
            k[b, n - length:], v[b, n - length:] = flat_k[slots], flat_v[slots]
        return k, v


class Attention(nn.Module):
    def __init__(self, args, layer_id):
        super().__init__()
        self.layer_id, self.n_heads, self.head_dim = layer_id, args.n_heads, args.head_dim
        self.sliding_window = args.sliding_window
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, meta, cache):
        q = self.wq(x).view(-1, self.n_heads, self.head_dim)
        k = self.wk(x).view(-1, self.n_heads, self.head_dim)
        v = self.wv(x).view(-1, self.n_heads, self.head_dim)
        cache.write(self.layer_id, meta["slots"], k, v)
        if meta["decode"]:
            keys, values = cache.gather_left_padded(self.layer_id, meta["block_tables"], meta["seq_lens"])
            n = keys.shape[1]
            col = torch.arange(n)[None, :]
            lens = meta["seq_lens"][:, None]
            keep = col >= n - lens  # the request's own keys (left padding before them)
            if FIXED:
                keep &= col >= n - self.sliding_window
            scores = torch.einsum("bhd,bnhd->bhn", q, keys) / self.head_dim ** 0.5
            scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
            out = torch.einsum("bhn,bnhd->bhd", scores.softmax(-1), values)
        else:
            out = torch.empty_like(q)
            start = 0
            for length in meta["seq_lens"].tolist():
                qi = torch.arange(length)[:, None]
                ki = torch.arange(length)[None, :]
                keep = (ki <= qi) & (ki > qi - self.sliding_window)
                sl = slice(start, start + length)
                out[sl] = F.scaled_dot_product_attention(q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None],
                                                         v[sl].transpose(0, 1)[None], attn_mask=keep)[0].transpose(0, 1)
                start += length
        return self.wo(out.reshape(x.shape[0], -1))


class Block(nn.Module):
    def __init__(self, args, layer_id):
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.norm = nn.RMSNorm(args.dim)
        self.ff = nn.Sequential(nn.Linear(args.dim, 2 * args.dim), nn.SiLU(), nn.Linear(2 * args.dim, args.dim))

    def forward(self, x, meta, cache):
        x = x + self.attention(self.norm(x), meta, cache)
        return x + self.ff(x)


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([Block(args, i) for i in range(args.n_layers)])
        self.out = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens, meta, cache):
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h, meta, cache)
        return self.out(h)


args = ModelArgs()
model = Transformer(args).eval()
cache = PagedCache(args, num_blocks=16)
prompts = [torch.randint(0, 64, (7,)), torch.randint(0, 64, (10,))]
block_tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
seq_lens = torch.tensor([len(p) for p in prompts])


def slots_of(b, positions):
    return block_tables[b, positions // BLOCK] * BLOCK + positions % BLOCK


with torch.no_grad():
    slots = torch.cat([slots_of(b, torch.arange(len(p))) for b, p in enumerate(prompts)])
    logits = model(torch.cat(prompts), {"decode": False, "seq_lens": seq_lens, "slots": slots}, cache)
    nxt = logits[torch.cumsum(seq_lens, 0) - 1].argmax(-1)
    out = [nxt.tolist()]
    for step in range(3):
        slots = torch.stack([slots_of(b, seq_lens[b:b + 1])[0] for b in range(2)])
        seq_lens = seq_lens + 1
        meta = {"decode": True, "seq_lens": seq_lens, "slots": slots, "block_tables": block_tables}
        nxt = model(nxt, meta, cache).argmax(-1)
        out.append(nxt.tolist())
print("generated:", out)
