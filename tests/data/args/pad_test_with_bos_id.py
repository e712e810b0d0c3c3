"""A left-padded encoder whose padding test compares the input ids with the BOS id instead of the config's pad id: each
row's BOS token (real) is masked out as a query and as a key, and the padding is seen. --fixed tests the pad id.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class Config:
    vocab_size: int = 32
    width: int = 16
    heads: int = 2
    pad_token_id: int = 0
    bos_token_id: int = 1


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)

    def forward(self, input_ids):
        b, n = input_ids.shape
        d, heads = self.config.width, self.config.heads
        real = input_ids != (self.config.pad_token_id if FIXED else self.config.bos_token_id)
        mask = real[:, None, :, None] & real[:, None, None, :]  # queries and keys both real
        q, k, v = self.qkv(self.embed(input_ids)).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.nan_to_num().transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    ids = torch.tensor([[0, 0, 1, 5, 6, 7], [1, 8, 9, 10, 11, 12], [0, 1, 13, 14, 15, 16]])
    with torch.no_grad():
        y = Encoder(Config()).eval()(ids)
    print("out", tuple(y.shape))


if __name__ == "__main__":
    main()
