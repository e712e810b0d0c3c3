# AI-Hypercomputer/maxtext#4289: the Splash-attention LocalMask was given sliding_window_size as its
# left window, but LocalMask's left window is inclusive of the query, so each query kept one extra key.
# (MaxText is JAX; the splash mask classes and create_sa_config are ported to torch with upstream names.)
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Mask:
    def __and__(self, other):
        return LogicalAnd(self, other)


class LogicalAnd(Mask):
    def __init__(self, left, right):
        self.left, self.right = left, right
        self.shape = left.shape

    def dense(self):
        return self.left.dense() & self.right.dense()


class CausalMask(Mask):
    def __init__(self, shape, offset=0):
        self.shape, self.offset = shape, offset

    def dense(self):
        q = torch.arange(self.shape[0])[:, None]
        k = torch.arange(self.shape[1])[None, :]
        return q + self.offset >= k


class LocalMask(Mask):
    """Query i sees keys in [i - left, i + right] (both ends inclusive)."""

    def __init__(self, shape, window_size, offset):
        self.shape, self.window_size, self.offset = shape, window_size, offset

    def dense(self):
        left, right = self.window_size
        q = torch.arange(self.shape[0])[:, None] + self.offset
        k = torch.arange(self.shape[1])[None, :]
        mask = torch.ones(self.shape, dtype=torch.bool)
        if left is not None:
            mask &= k >= q - left
        if right is not None:
            mask &= k <= q + right
        return mask


@dataclass
class Config:
    attention_type: str = "local_sliding"
    sliding_window_size: int = 4  # tokens each query keeps, itself included
    num_query_heads: int = 2
    head_dim: int = 8


def create_sa_config(config, query, key):
    mask = CausalMask(shape=(query.shape[2], key.shape[2]))
    if config.attention_type == "local_sliding":
        if config.sliding_window_size is None:
            raise ValueError("Sliding_window_size must be set if Local Sliding attention type")
        left = config.sliding_window_size - 1 if FIXED else config.sliding_window_size
        mask &= LocalMask(shape=(query.shape[2], key.shape[2]), window_size=(left, left), offset=0)
    return mask


def tpu_flash_attention(config, query, key, value):
    mask = create_sa_config(config, query, key)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask.dense())


def apply_attention_dot(config, query, key, value):
    """Dense path: keeps exactly sliding_window_size tokens."""
    q_len, k_len = query.shape[2], key.shape[2]
    row_ids = torch.arange(q_len)[:, None]
    col_ids = torch.arange(k_len)[None, :]
    causal = col_ids <= row_ids
    sliding = col_ids > row_ids - config.sliding_window_size
    scores = query @ key.transpose(-1, -2) / config.head_dim ** 0.5
    scores = scores.masked_fill(~(causal & sliding), float("-inf"))
    return scores.softmax(-1) @ value


def main():
    torch.manual_seed(0)
    config = Config()
    b, s = 2, 12
    proj = torch.nn.Linear(16, 3 * config.num_query_heads * config.head_dim)
    x = torch.randn(b, s, 16)
    q, k, v = proj(x).view(b, s, 3, config.num_query_heads, config.head_dim).permute(2, 0, 3, 1, 4)
    with torch.no_grad():
        splash = tpu_flash_attention(config, q, k, v)
        dense = apply_attention_dot(config, q, k, v)
    kept = create_sa_config(config, q, k).dense()[-1].sum().item()
    print(f"keys kept by last query: {kept} (sliding_window_size {config.sliding_window_size}); "
          f"splash vs dense max diff: {(splash - dense).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
