"""Cost of zero-keys-seen's reading at each SDPA call (trace/zerokv.py) over a static KV cache, on the CPU.

    python benchmarks/zerokv.py [--slots 65536] [--filled 1000] [--steps 20] [--runs 7]

A decode loop over a preallocated cache of --slots keys (batch 1, 8 heads of 64: zeros until written, as a static
cache is), --filled of them written, each step writing one more and calling SDPA with a bool mask that keeps the
slots written (the unwritten tail hidden: a correct program). Timed untraced and inside `maskcli.trace()`, the two
alternating, in this process, by the CPU clock: the median of the paired ratios and trace's cost a call; and the
zero-K/V reading alone (zero_kv on the same call's tensors), median of its calls. It used to read each key's first
dimension in every head of K and V wherever an edge slot was zero (a static cache's last slot is): its cost grew with
--slots; it reads from the edges of the keys the mask keeps now, so it does not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import maskcli
from maskcli.trace.zerokv import zero_kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=65536)
    parser.add_argument("--filled", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    heads, dim = 8, 64
    k_cache, v_cache = torch.zeros(1, heads, args.slots, dim), torch.zeros(1, heads, args.slots, dim)
    k_cache[:, :, : args.filled] = torch.randn(1, heads, args.filled, dim)
    v_cache[:, :, : args.filled] = torch.randn(1, heads, args.filled, dim)
    slots = torch.arange(args.slots)

    def decode() -> None:
        for step in range(args.steps):
            at = args.filled + step
            k_cache[:, :, at] = torch.randn(heads, dim)  # (written in place, as a static cache is)
            v_cache[:, :, at] = torch.randn(heads, dim)
            q = torch.randn(1, heads, 1, dim)
            F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=(slots <= at)[None, None, None])

    def plain() -> float:
        start = time.process_time()
        decode()
        return time.process_time() - start

    def traced() -> float:
        start = time.process_time()
        with maskcli.trace() as t:
            decode()
        spent = time.process_time() - start
        assert len(t.calls) == args.steps
        return spent

    plain(), traced()  # warm-up
    pairs = [(plain(), traced()) for _ in range(args.runs)]
    ratios = [b / a for a, b in pairs]
    costs = [(b - a) / args.steps for a, b in pairs]
    q = torch.randn(1, heads, 1, dim)
    mask = (slots <= args.filled)[None, None, None]
    alone = []
    for _ in range(50):
        start = time.perf_counter()
        zero_kv(q, k_cache, v_cache, tuple(k_cache.shape), mask)
        alone.append(time.perf_counter() - start)
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    c1, cost, c3 = statistics.quantiles(costs, n=4)
    print(f"static cache of {args.slots:,} slots ({args.filled:,} written), {args.steps} decode steps, {args.runs} pairs, CPU clock: "
          f"untraced median {statistics.median(a for a, _ in pairs) * 1e3:.1f} ms, traced {statistics.median(b for _, b in pairs) * 1e3:.1f} ms; "
          f"traced / untraced median {median:.2f}x (quartiles {q1:.2f}-{q3:.2f}); trace's cost a call {cost * 1e3:.3f} ms "
          f"(quartiles {c1 * 1e3:.3f}-{c3 * 1e3:.3f}); the zero-K/V reading alone {statistics.median(alone) * 1e3:.3f} ms a call")


if __name__ == "__main__":
    main()
