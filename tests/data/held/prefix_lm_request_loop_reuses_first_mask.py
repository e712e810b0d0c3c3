"""A prefix-LM batch (a bidirectional prefix per request, then causal text: PaliGemma's shape) right-padded to one
length; the model holds the padded (B, 1, L, L) keep-mask as `attention_mask` and attends request by request over
each request's own tokens. The loop slices every request's block out of request 0's mask, so request 1 (prefix of 1)
gets request 0's prefix of 3: its first query sees keys 1-2, later text tokens. --fixed slices request i's own block.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def attend(q, k, v, block):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block)


class PrefixLM(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, hidden, attention_mask, lengths):
        outputs = []
        for i, n in enumerate(lengths):
            q, k, v = self.qkv(hidden[i:i + 1, :n]).view(1, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            row = i if FIXED else 0
            outputs.append(attend(q, k, v, attention_mask[row:row + 1, :, :n, :n]))
        return outputs


def main():
    torch.manual_seed(0)
    lengths, prefixes, width = [6, 4], [3, 1], 16
    size = max(lengths)
    q_pos, k_pos = torch.arange(size)[:, None], torch.arange(size)[None, :]
    masks = []
    for n, p in zip(lengths, prefixes):
        real = (q_pos < n) & (k_pos < n)
        masks.append(((k_pos <= q_pos) | ((q_pos < p) & (k_pos < p))) & real)
    attention_mask = torch.stack(masks)[:, None]  # (B, 1, L, L), True = may attend
    out = PrefixLM(width)(torch.randn(len(lengths), size, width), attention_mask, lengths)
    print("fixed" if FIXED else "buggy", [round(o.sum().item(), 4) for o in out])


if __name__ == "__main__":
    main()
