"""mistral-src one_file_ref.py: the prefill sliding-window band kept sliding_window + 1 keys.

Citation: mistralai/mistral-inference#137 ("Fix sliding window mask size in one_file_ref.py",
closed unmerged when the repository was archived): "the original mask would display one more column
than expected size."  Read: the PR description and one_file_ref.py `Transformer.forward` (the
mask lines); `Attention.forward` with its rolling cache is written from my knowledge of that file,
not re-read here, and the PR diff itself was not available to me (the fix below is the one the
description implies; the rolling cache holds exactly `sliding_window` entries).

Bug: `mask = torch.triu(torch.tril(ones, 0), diagonal=-self.args.sliding_window)` keeps keys
i - sliding_window .. i, i.e. sliding_window + 1 of them, while `ModelArgs.sliding_window` and the
rolling-buffer KV cache (size sliding_window) give a decode step exactly sliding_window keys;
prefill and decode disagree.
Fix: `diagonal=-self.args.sliding_window + 1`.

Reproduction: the one_file_ref model (ModelArgs dataclass, Attention with rolling cache
`cache_k[:, positions % sliding_window]`, additive log-mask on prefill), 2 layers, sliding_window=4,
a 7-token prompt prefilled in one call, then two single-token decode steps.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    head_dim: int
    hidden_dim: int
    n_heads: int
    n_kv_heads: int
    sliding_window: int
    norm_eps: float
    vocab_size: int
    max_batch_size: int = 0


def repeat_kv(keys: torch.Tensor, values: torch.Tensor, repeats: int):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=2)
    values = torch.repeat_interleave(values, repeats=repeats, dim=2)
    return keys, values


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_heads: int = args.n_heads
        self.n_kv_heads: int = args.n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
        self.sliding_window = self.args.sliding_window
        self.scale = self.args.head_dim ** -0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.cache_k = torch.empty((args.max_batch_size, args.sliding_window, self.n_kv_heads, self.args.head_dim))
        self.cache_v = torch.empty((args.max_batch_size, args.sliding_window, self.n_kv_heads, self.args.head_dim))

    def forward(self, x, freqs_cis, positions, mask: Optional[torch.Tensor]):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.args.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        # The cache is a rotating buffer
        scatter_pos = (positions[-self.sliding_window:] % self.sliding_window)[None, :, None, None]
        scatter_pos = scatter_pos.repeat(bsz, 1, self.n_kv_heads, self.args.head_dim)
        self.cache_k[:bsz].scatter_(dim=1, index=scatter_pos, src=xk[:, -self.sliding_window:])
        self.cache_v[:bsz].scatter_(dim=1, index=scatter_pos, src=xv[:, -self.sliding_window:])

        if positions.shape[0] > 1:
            # prefill
            key, value = repeat_kv(xk, xv, self.repeats)
        else:
            cur_pos = positions[-1].item() + 1
            key, value = repeat_kv(self.cache_k[:bsz, :cur_pos, ...], self.cache_v[:bsz, :cur_pos, ...], self.repeats)

        query = xq.transpose(1, 2)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)
        # scores : [bsz, n_heads, seqlen | 1, seqlen]
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scale
        if mask is not None:
            scores += mask[None, None, ...]
        scores = scores.float()
        scores = nn.functional.softmax(scores, dim=-1).type_as(query)
        output = torch.matmul(scores, value)  # (bs, n_local_heads, slen, head_dim)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = nn.Sequential(nn.Linear(args.dim, args.hidden_dim, bias=False), nn.SiLU(),
                                          nn.Linear(args.hidden_dim, args.dim, bias=False))
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, positions, mask):
        h = x + self.attention.forward(self.attention_norm(x), freqs_cis, positions, mask)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(args=args) for _ in range(args.n_layers)])
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(self.args.head_dim, 128)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        h = self.tok_embeddings(input_ids)
        freqs_cis = self.freqs_cis[positions]

        mask: Optional[torch.Tensor] = None
        if input_ids.shape[1] > 1:
            seqlen = input_ids.shape[1]
            tensor = torch.full((seqlen, seqlen), dtype=h.dtype, fill_value=1, device=h.device)
            mask = torch.tril(tensor, diagonal=0).to(h.dtype)
            # make the mask banded to account for sliding window
            if FIXED:
                mask = torch.triu(mask, diagonal=-self.args.sliding_window + 1)
            else:
                mask = torch.triu(mask, diagonal=-self.args.sliding_window)
            mask = torch.log(mask)

        for layer in self.layers:
            h = layer(h, freqs_cis, positions, mask)
        return self.output(self.norm(h)).float()


def main():
    torch.manual_seed(0)
    args = ModelArgs(dim=16, n_layers=2, head_dim=8, hidden_dim=32, n_heads=2, n_kv_heads=1,
                     sliding_window=4, norm_eps=1e-5, vocab_size=50, max_batch_size=1)
    model = Transformer(args).eval()
    prompt = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        logits = model(prompt, torch.arange(7))
        tokens = []
        for pos in range(7, 9):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt.item())
            logits = model(nxt, torch.tensor([pos]))
    print("generated", tokens, "last logit", round(logits[0, -1, 0].item(), 4))


if __name__ == "__main__":
    main()
