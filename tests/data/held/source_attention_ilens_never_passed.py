"""A batched greedy decode whose source attention is handed no mask while the caller holds the source lengths.

Written for checks/held.py another way than ESPnet's `forward_one_step` (espnet#5679, `hlens` held by main): here the
lengths are `ilens`, the batch is left-padded (its real frames last), and the attention is one function
`source_attention(query, key, value, mask=None)` over 2 heads that the decoder calls with the encoder output as `key`
and `value`, one query per step, keys the whole padded memory. `--fixed` hands it the mask built from `ilens`.
"""
import sys

import torch

FIXED = "--fixed" in sys.argv


def source_attention(query, key, value, heads, mask=None):
    b, lq, d = query.shape
    q = query.view(b, lq, heads, d // heads).transpose(1, 2)
    k = key.view(b, -1, heads, d // heads).transpose(1, 2)
    v = value.view(b, -1, heads, d // heads).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)) / (d // heads) ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, lq, d)


def decode(memory, steps, proj, mask=None):
    state = torch.zeros(memory.shape[0], 1, memory.shape[-1])
    for _ in range(steps):
        state = torch.tanh(proj(state + source_attention(state, memory, memory, 2, mask)))
    return state


def main():
    torch.manual_seed(0)
    ilens = torch.tensor([4, 7])
    memory = torch.randn(2, 7, 8)  # left-padded: the real frames of a row are its last ilens
    real = torch.arange(7)[None, :] >= 7 - ilens[:, None]
    proj = torch.nn.Linear(8, 8)
    with torch.no_grad():
        out = decode(memory, 3, proj, real if FIXED else None)
    print("fixed" if FIXED else "buggy", round(float(out.sum()), 4))


if __name__ == "__main__":
    main()
