"""Meta-llama-style generation whose Transformer.forward slices the rotary table from 0 at every step.

The same bug as lag-llama 4a2d099, written another way: a precomputed complex `freqs_cis` table (no rotary module,
no inv_freq buffer), a (B, T, H, D) cache grown by torch.cat with the keys stored rotated, eager softmax behind an
additive mask, two prompts left-padded (row 0 by 2, row 1 by 0). Before the fix `self.freqs_cis[:seqlen]`: at each
decode step (seqlen 1) the new query and key are rotated at position 0, wherever the cache has got to. The fix slices
`self.freqs_cis[start_pos : start_pos + seqlen]`.
"""
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 64
    max_seq_len: int = 32
    pad_id: int = 0


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.cache_k = self.cache_v = None

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        if start_pos == 0:
            self.cache_k, self.cache_v = xk, xv
        else:
            self.cache_k = torch.cat([self.cache_k, xk], dim=1)
            self.cache_v = torch.cat([self.cache_v, xv], dim=1)
        q, k, v = xq.transpose(1, 2), self.cache_k.transpose(1, 2), self.cache_v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        return self.wo(torch.matmul(scores, v).transpose(1, 2).reshape(bsz, seqlen, -1))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([Attention(args) for _ in range(args.n_layers)])
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len * 2)

    @torch.no_grad()
    def forward(self, tokens, start_pos: int, key_padding: torch.Tensor):
        bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        if FIXED:
            freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        else:
            freqs_cis = self.freqs_cis[:seqlen]
        total = start_pos + seqlen
        keep = torch.ones(seqlen, total, dtype=torch.bool).tril(diagonal=start_pos)[None] & key_padding[:, None, :total]
        keep = keep | (torch.arange(total)[None, :] == torch.arange(start_pos, total)[:, None])[None]  # (a pad sees itself)
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))[:, None]
        for layer in self.layers:
            h = h + layer(h, start_pos, freqs_cis, mask)
        return self.output(h)


def generate(model, prompts, max_gen_len=4):
    args = model.args
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width + max_gen_len), args.pad_id, dtype=torch.long)
    key_padding = torch.zeros(tokens.shape, dtype=torch.bool)
    for i, p in enumerate(prompts):  # left-padded
        tokens[i, width - len(p): width] = torch.tensor(p)
        key_padding[i, width - len(p):] = True
    prev_pos = 0
    for cur_pos in range(width, width + max_gen_len):
        logits = model(tokens[:, prev_pos:cur_pos], prev_pos, key_padding)
        tokens[:, cur_pos] = logits[:, -1].argmax(-1)
        prev_pos = cur_pos
    return tokens


def main():
    torch.manual_seed(0)
    model = Transformer(ModelArgs()).eval()
    print(generate(model, [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]).tolist())


if __name__ == "__main__":
    main()
