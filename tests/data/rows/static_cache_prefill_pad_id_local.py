"""A static-cache decoder whose left-padded prefill attends its padding: the pad id is stated only by `sample`'s own
`pad_token_id` argument.

Written with a `cache_position` argument (transformers' name) and a hand-written softmax over every one of the cache's
`max_len` slots: the mask is the model's own `tril` buffer cut at `cache_position`, unwritten slots hidden by it. Two
prompts of 5 and 3 tokens, left-padded with id 2 to 5; buggy: the shorter row's real tokens see its two pads at
prefill; fixed (--fixed): `sample` hands the model `keep = ids != pad_token_id` and the mask ands it in.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, dim, max_len):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("k", torch.zeros(2, max_len, dim), persistent=False)
        self.register_buffer("v", torch.zeros(2, max_len, dim), persistent=False)

    def forward(self, x, mask, cache_position):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.k[:, cache_position] = k
        self.v[:, cache_position] = v
        scores = q @ self.k.transpose(1, 2) / x.shape[-1] ** 0.5
        return x + scores.masked_fill(~mask, -1e9).softmax(-1) @ self.v


class Model(nn.Module):
    def __init__(self, vocab=30, dim=16, max_len=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, max_len) for _ in range(2)])
        self.out = nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)
        self.keep = None

    def forward(self, input_ids, cache_position, keep=None):
        if keep is not None:
            self.keep = keep  # (the prompt's real tokens, kept for the later steps)
        mask = self.causal[cache_position][None].expand(input_ids.shape[0], -1, -1)
        if self.keep is not None:
            mask = mask & self.keep[:, None, :]
        h = self.emb(input_ids)
        for block in self.blocks:
            h = block(h, mask, cache_position)
        return self.out(h)


@torch.no_grad()
def sample(model, prompts, steps=2, pad_token_id=2):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    keep = None
    if FIXED:
        keep = torch.ones(ids.shape[0], 10, dtype=torch.bool)
        keep[:, :width] = ids != pad_token_id
    logits = model(ids, torch.arange(width), keep=keep)
    out = []
    for step in range(steps):
        nxt = logits[:, -1:].argmax(-1)
        out.append(nxt)
        logits = model(nxt, torch.tensor([width + step]))
    return torch.cat(out, dim=1)


def main():
    torch.manual_seed(0)
    model = Model().eval()
    out = sample(model, [[5, 6, 7, 8, 9], [11, 12, 13]])
    print(f"{'fixed' if FIXED else 'buggy'} sampled {out.tolist()}")


if __name__ == "__main__":
    main()
