"""An inference engine's backend object converts the model's sliding_window to its kernel's bounds one key wide.

The engine keeps the model's config as a dataclass in the function that serves; its attention backend (a plain object,
not a module, as vLLM's and SGLang's are) holds the kernel's bounds `sliding_window = (left, right)`, where a query at p
sees keys p - left .. p + right. The buggy backend hands `left = sliding_window`: every query sees sliding_window + 1
keys. `--fixed`: left = sliding_window - 1 (the config's window counts the query itself).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class EngineModelConfig:
    num_heads: int = 2
    head_dim: int = 4
    sliding_window: int = 3


class PagedBackend:
    def __init__(self, model_config):
        self.num_heads = model_config.num_heads
        left = model_config.sliding_window - 1 if FIXED else model_config.sliding_window
        self.sliding_window = (left, 0)

    def run(self, q, k, v, lengths):
        """Each request's queries over its own keys, an additive float mask from the kernel's bounds."""
        left, right = self.sliding_window
        outputs, start = [], 0
        for length in lengths:
            rows = torch.arange(length).unsqueeze(1)
            cols = torch.arange(length).unsqueeze(0)
            bias = torch.zeros(length, length)
            bias.masked_fill_((cols > rows + right) | (cols < rows - left), float("-inf"))
            sl = slice(start, start + length)
            outputs.append(F.scaled_dot_product_attention(q[:, sl], k[:, sl], v[:, sl], attn_mask=bias))
            start += length
        return torch.cat(outputs, dim=1)


def serve():
    torch.manual_seed(0)
    model_config = EngineModelConfig()
    backend = PagedBackend(model_config)
    lengths = [6, 5]
    q, k, v = (torch.randn(model_config.num_heads, sum(lengths), model_config.head_dim) for _ in range(3))
    print(backend.run(q, k, v, lengths)[0, -1])


if __name__ == "__main__":
    serve()
