"""Batched generation with a left-padded prompt, a KV cache and a sliding window, as a hand-written Mistral
(mistral-inference's reference `one_file_ref.py`: `sliding_window` in ModelArgs; the batch left-padded as
transformers' generate pads it): the model call gets the 2-D `attention_mask` (1 = real, grown by one each step)
and `position_ids` counted from each row's first real token. The cache keeps every key; the mask keeps a key where
it is real, not later, and fewer than `sliding_window` positions back, at prefill and at every decode step.

Right: each real query sees the last 3 real-or-not positions up to itself, of them only the real ones."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 16
    n_layers: int = 2
    n_heads: int = 2
    sliding_window: int = 3
    vocab_size: int = 32


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.cache_k = self.cache_v = None

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        if self.cache_k is not None:
            k, v = torch.cat([self.cache_k, k], 2), torch.cat([self.cache_v, v], 2)
        self.cache_k, self.cache_v = k, v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Attention(args) for _ in range(args.n_layers))
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids):
        t, total = input_ids.shape[1], attention_mask.shape[1]
        q_pos = torch.arange(total - t, total)[:, None]
        k_pos = torch.arange(total)[None, :]
        allowed = (k_pos <= q_pos) & (q_pos - k_pos < self.args.sliding_window)
        mask = allowed[None, None] & attention_mask.bool()[:, None, None, :]
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = h + layer(h, mask)
        return self.output(h)


def main():
    torch.manual_seed(0)
    model = Transformer(ModelArgs()).eval()
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        for _ in range(3):
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
            logits = model(input_ids, attention_mask, position_ids)
            input_ids = logits[:, -1:].argmax(-1)
            attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=attention_mask.dtype)], 1)
    print(tuple(attention_mask.shape))


if __name__ == "__main__":
    main()
