"""A data-parallel training loop over gloo on the CPU, as torchrun starts it: each rank pads its own batch.

python -m torch.distributed.run --nproc-per-node 2 -m maskcli trace --save run.pt tests/data/ranks/ddp.py
Its arguments: --window W (every rank's window), --odd-window W (rank 1's instead: the bug), --pad left|right,
--odd-pad left|right (rank 1's side), --as-rank R (one process doing rank R's batch alone, no launcher),
--fail R (rank R raises after training).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--window", type=int, default=3)
parser.add_argument("--odd-window", type=int, default=None)
parser.add_argument("--pad", default="right")
parser.add_argument("--odd-pad", default=None)
parser.add_argument("--as-rank", type=int, default=None)
parser.add_argument("--fail", type=int, default=None)
args = parser.parse_args()

LENGTH, DIM = 6, 8


def lengths_of(rank: int) -> list[int]:
    """Each rank's batch: two sequences, their lengths the rank's own."""
    return [LENGTH - rank % 3, LENGTH - (rank + 1) % 3]


def mask_of(lengths, width, side):
    q = torch.arange(LENGTH)[:, None]
    k = torch.arange(LENGTH)[None, :]
    rows = []
    for n in lengths:
        real = torch.arange(LENGTH) < n if side == "right" else torch.arange(LENGTH) >= LENGTH - n
        rows.append((k <= q) & (q - k < width) & real[None, :])
    return torch.stack(rows)[:, None]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, mask):
        q = self.proj(x)[:, None]
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)[:, 0]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x, mask):
        for layer in self.layers:
            x = x + layer(x, mask)
        return x


if args.as_rank is None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
else:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("ALONE_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    rank = args.as_rank
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(Model())
optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
width = args.odd_window if rank == 1 and args.odd_window is not None else args.window
side = args.odd_pad if rank == 1 and args.odd_pad is not None else args.pad
mask = mask_of(lengths_of(rank), width, side)
for step in range(2):
    x = torch.randn(2, LENGTH, DIM, generator=torch.Generator().manual_seed(rank * 10 + step))
    loss = model(x, mask).pow(2).mean()
    optimiser.zero_grad()
    loss.backward()
    optimiser.step()
dist.destroy_process_group()
if args.fail == rank:
    raise RuntimeError(f"rank {rank} fails after training")
