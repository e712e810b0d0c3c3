"""A torch port of a Flax local-attention layer whose padded-batch branch builds its mask without the window.

Written for maskcli's tests (checks/real.py's reading of a `pad_mask` True on the tokens, checks/handed.py), in the
convention of Flax and the JAX Gemma reference: `pad_mask` is True on the real tokens (the opposite of torch's
`key_padding_mask`), and the local layer holds its `sliding_window_size` (a query sees that many keys back). Its bug:
the mask is built in two branches, and only the unpadded one ANDs in the window, so a right-padded batch attends
every earlier token. Fixed: the window is ANDed in both branches.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class LocalAttention(nn.Module):
    def __init__(self, features=16, num_heads=2, sliding_window_size=3):
        super().__init__()
        self.num_heads = num_heads
        self.sliding_window_size = sliding_window_size
        self.qkv = nn.Linear(features, 3 * features)

    def _window(self, length):
        at = torch.arange(length)
        return (at[:, None] - at[None, :]) < self.sliding_window_size

    def forward(self, x, pad_mask=None):
        b, n, f = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, f // self.num_heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if pad_mask is None:
            mask = (causal & self._window(n))[None, None]
        else:
            mask = causal[None, None] & pad_mask[:, None, None, :]
            if FIXED:
                mask = mask & self._window(n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, f)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.local = LocalAttention()

    def forward(self, tokens, pad_mask=None):
        return self.local(self.embed(tokens), pad_mask=pad_mask)


def main():
    torch.manual_seed(0)
    model = Decoder().eval()
    tokens = torch.randint(1, 50, (2, 8))
    pad_mask = torch.arange(8)[None, :] < torch.tensor([[8], [5]])  # True = a token (Flax's way), right-padded
    tokens[~pad_mask] = 0
    with torch.no_grad():
        y = model(tokens, pad_mask=pad_mask)
    print("y[0, -1, :3]:", [round(v, 4) for v in y[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
