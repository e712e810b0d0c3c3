"""Overhead of maskcli's attend pipeline against the same computation written directly in torch.

    python benchmarks/attend.py [--runs 9] [--lengths 64,512,2048] [--heads 8]

For each length L (8 heads, head size 64, batch 1, causal mask) it times, in one run and
interleaved, (a) maskcli.run.run_attention: mask predicate built and materialised, every
stage kept, findings computed; and (b) the hand-written torch reference: torch.tril mask,
masked_fill(-inf), softmax, matmul. It prints the medians and their ratio (target <= 1.3;
the torch import both pay is outside the timing). On a machine with CUDA it does the same
on cuda, synchronising before each clock read.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from maskcli.inputs import QKV
from maskcli.run import run_attention
from maskcli.spec import make_spec


def reference(q, k, v, device):
    length = q.shape[-2]
    keep = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return weights @ v


def clock(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--lengths", default="64,512,2048")
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.runs} runs, median")
    for device in devices:
        for length in map(int, args.lengths.split(",")):
            spec = make_spec("causal", length=length, heads=args.heads)
            generator = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, args.heads, length, 64, generator=generator).to(device) for _ in range(3))
            qkv = QKV(q, k, v, "benchmark")
            ours = lambda: run_attention(spec, qkv, device, torch.float32)  # noqa: E731
            ref = lambda: reference(q, k, v, device)  # noqa: E731
            torch.testing.assert_close(ours().stages.output, ref(), atol=1e-5, rtol=1e-5)  # same work, and warm-up
            times_ours, times_ref = [], []
            for _ in range(args.runs):
                times_ref.append(clock(ref, device))
                times_ours.append(clock(ours, device))
            a, b = statistics.median(times_ours), statistics.median(times_ref)
            verdict = "OK" if a / b <= 1.3 else "OVER"
            print(f"{device.type:4s} L={length:5d} H={args.heads}: maskcli {a * 1000:9.2f} ms  torch {b * 1000:9.2f} ms  ratio {a / b:5.2f} (target <= 1.3) {verdict}")


if __name__ == "__main__":
    main()
