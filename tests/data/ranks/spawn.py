"""DDP over gloo on the CPU in processes the program starts itself with torch.multiprocessing.spawn.

maskcli trace --save run.pt tests/data/ranks/spawn.py [--port P]: each spawned process pads its own batch."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

LENGTH = 6


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        q = self.proj(x)[:, None]
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)[:, 0]


def padded(n: int) -> torch.Tensor:
    """Causal over LENGTH positions, the keys from n on padding."""
    return torch.tril(torch.ones(LENGTH, LENGTH, dtype=torch.bool)) & (torch.arange(LENGTH) < n)[None, :]


def work(rank: int, world: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Attention())
    mask = padded(LENGTH - rank)[None, None]
    model(torch.randn(1, LENGTH, 8), mask).sum().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", default="29544")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    mp.spawn(work, args=(args.world, args.port), nprocs=args.world)
