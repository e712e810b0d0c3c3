"""Context-parallel causal attention over gloo on the CPU, written by hand as projects write it: each rank holds a
head-tail share of one sequence (chunks r and 2N-1-r of 2N, PyTorch's _HeadTailLoadBalancer) and attends to every
rank's keys, either gathered at once (all_gather, one SDPA call on its part of the mask) or passed round a ring
(one SDPA call per step on the keys of rank (r - step) mod N, merged by their log-sum-exp).

python -m torch.distributed.run --nproc-per-node 2 -m maskcli trace --save run.pt tests/data/ranks/context_parallel.py
Its arguments: --ring (a ring, not all_gather), --len L, --window W (causal & window(W)), --bug local (every rank's
mask on its local indices) or --bug drop (rank 1 hides key 0). The output is checked against attention over the
whole sequence on every rank: a bug makes it differ, and the program says so (but exits 0: the mask is maskcli's).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--ring", action="store_true")
parser.add_argument("--len", type=int, default=16)
parser.add_argument("--window", type=int, default=None)
parser.add_argument("--bug", choices=["local", "drop"], default=None)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
L, D = args.len, 8
chunk = L // (2 * world)


def positions(r: int) -> torch.Tensor:
    """Rank r's positions, in its local order: head chunk r, then tail chunk 2N-1-r."""
    return torch.cat([torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * world - 1 - r) * chunk, (2 * world - r) * chunk)])


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    keep = k_pos[None, :] <= q_pos[:, None]
    if args.window is not None:
        keep &= q_pos[:, None] - k_pos[None, :] < args.window
    return keep


def part_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    if args.bug == "local":  # the slip: row i as position i, key j as position j
        q_pos, k_pos = torch.arange(q_pos.numel()), torch.arange(k_pos.numel())
    keep = allowed(q_pos, k_pos)
    if args.bug == "drop" and rank == 1:
        keep &= k_pos[None, :] != 0
    return keep


torch.manual_seed(0)
x = torch.randn(1, 1, L, D)  # the same sequence on every rank (one seed)
mine = positions(rank)
q, k, v = x[:, :, mine], x[:, :, mine] * 0.5, x[:, :, mine] + 1

if not args.ring:
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    gathered = torch.cat([positions(r) for r in range(world)])
    out = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=part_mask(mine, gathered))
else:
    outs, lses = [], []
    k_now, v_now = k.clone(), v.clone()
    for step in range(world):
        source = (rank - step) % world
        block = part_mask(mine, positions(source))
        outs.append(F.scaled_dot_product_attention(q, k_now, v_now, attn_mask=block))
        scores = (q @ k_now.transpose(-1, -2)) / D ** 0.5
        lses.append(torch.logsumexp(scores.masked_fill(~block, float("-inf")), dim=-1, keepdim=True))
        if step < world - 1:  # pass the keys on: send to the next rank, receive from the one before
            k_next, v_next = torch.empty_like(k_now), torch.empty_like(v_now)
            ops = [dist.P2POp(dist.isend, k_now, (rank + 1) % world), dist.P2POp(dist.isend, v_now, (rank + 1) % world),
                   dist.P2POp(dist.irecv, k_next, (rank - 1) % world), dist.P2POp(dist.irecv, v_next, (rank - 1) % world)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            k_now, v_now = k_next, v_next
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(part - lse) * o for part, o in zip(lses, outs))

whole = F.scaled_dot_product_attention(x, x * 0.5, x + 1, attn_mask=allowed(torch.arange(L), torch.arange(L)))[:, :, mine]
if not torch.allclose(out, whole, atol=1e-5):
    print(f"rank {rank}: the output differs from attention over the whole sequence")
dist.destroy_process_group()
