"""A summariser's decoder over its encoder's memory, the sources padded to a fixed length of 8 by a tokenizer (its
`pad_token_id` 0, EOS 2), so no row is whole. The decoder's cross-attention hands SDPA `src_ids == pad` (True = a pad)
as its bool attn_mask, which SDPA reads as True = may attend: each target token attends only to the source's pad
positions; --fixed: `src_ids != pad`."""

import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class CrossAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.kv = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, 2 * dim)

    def forward(self, x, memory, memory_mask):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(memory).view(b, memory.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=memory_mask[:, None, None, :])
        return x + out.transpose(1, 2).reshape(b, n, d)


class Summariser(torch.nn.Module):
    def __init__(self, vocab=30, dim=16, heads=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.encode = torch.nn.Linear(dim, dim)
        self.cross = CrossAttention(dim, heads)

    def forward(self, input_ids, decoder_input_ids, pad):
        memory = self.encode(self.embed(input_ids))
        memory_mask = input_ids != pad if FIXED else input_ids == pad
        return self.cross(self.embed(decoder_input_ids), memory, memory_mask)


def main():
    torch.manual_seed(0)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2, padding_side="right")
    ids = torch.tensor([[4, 5, 6, 7, 8, 2, 0, 0], [4, 11, 12, 2, 0, 0, 0, 0]])
    with torch.no_grad():
        out = Summariser().eval()(ids, torch.tensor([[1, 3, 5], [1, 3, 5]]), tokenizer.pad_token_id)
    print(out.shape)


if __name__ == "__main__":
    main()
