"""Overhead of maskcli's attend pipeline against the same computation written directly in torch.

    python benchmarks/attend.py [--runs 15] [--lengths 64,512,2048] [--heads 8] [--devices cpu,cuda]

For each length L (8 heads, head size 64, batch 1, causal mask, float32) it times, in one
run, (a) maskcli.attention.run.run_attention: the mask predicate built and materialised, every
stage computed and kept, findings computed; and (b) the hand-written torch reference:
torch.tril mask, masked_fill(-inf), softmax, matmul (the tutorial's code). The torch
import both pay is outside the timing.

Each sample times a block of back-to-back calls long enough (about 20 ms) for the
clock to be exact, and the two sides alternate block by block, so a slow spell on a
shared machine hits both. It prints the median time per call of each side and the
median of the paired ratios with their quartiles (target <= 1.3). On cuda it
waits for the GPU after every call of either side, and also prints the peak memory of one call
of each (maskcli keeps every stage, so it needs more).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from maskcli.attention.inputs import QKV
from maskcli.attention.run import run_attention
from maskcli.mask import build

TARGET = 1.3
BLOCK_SECONDS = 0.02


def reference(q, k, v, device):
    length = q.shape[-2]
    keep = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return weights @ v


def per_call(fn, calls: int, device) -> float:
    """Seconds per call over a block of `calls` back-to-back calls.

    On cuda each call is waited for: maskcli reads its findings back, so it waits for the
    GPU every call, and a reference left to queue its kernels would be timed for throughput.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
        sync(device)
    return (time.perf_counter() - start) / calls


def compare(ours, ref, device, runs: int) -> tuple[float, float, list[float]]:
    """Median seconds per call of each, and the paired ratios ours / ref, blocks alternating."""
    calls = max(1, round(BLOCK_SECONDS / per_call(ref, 3, device)))
    for _ in range(2):  # warm-up: allocator caches, lazy kernel loading
        per_call(ours, calls, device), per_call(ref, calls, device)
    times_ours, times_ref = [], []
    for _ in range(runs):
        times_ref.append(per_call(ref, calls, device))
        times_ours.append(per_call(ours, calls, device))
    ratios = [a / b for a, b in zip(times_ours, times_ref)]
    return statistics.median(times_ours), statistics.median(times_ref), ratios


def peak_bytes(fn, device) -> int:
    """Peak CUDA memory allocated during one call, above what was allocated before it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    del result
    return torch.cuda.max_memory_allocated(device) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="samples per side (default 15)")
    parser.add_argument("--lengths", default="64,512,2048")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--devices", default="cpu,cuda", help="those present are used (default cpu,cuda)")
    args = parser.parse_args()
    wanted = args.devices.split(",")
    devices = [torch.device(d) for d in wanted if d == "cpu" or (d == "cuda" and torch.cuda.is_available())]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} cpu threads, {args.runs} samples a side, "
          f"blocks of about {BLOCK_SECONDS * 1000:.0f} ms")
    if torch.device("cuda") in devices:
        print(f"cuda: {torch.cuda.get_device_name()}")
    for device in devices:
        for length in map(int, args.lengths.split(",")):
            spec = build("causal", length=length, heads=args.heads)
            generator = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, args.heads, length, 64, generator=generator).to(device) for _ in range(3))
            qkv = QKV(q, k, v, "benchmark")
            ours = lambda: run_attention(spec, qkv, device, torch.float32)  # noqa: E731
            ref = lambda: reference(q, k, v, device)  # noqa: E731
            torch.testing.assert_close(ours().stages.output, ref(), atol=1e-5, rtol=1e-5)  # the same work
            a, b, ratios = compare(ours, ref, device, args.runs)
            low, mid, high = statistics.quantiles(ratios, n=4)
            verdict = "OK" if mid <= TARGET else "OVER"
            memory = ""
            if device.type == "cuda":  # every stage is kept, so more memory than the reference is expected
                mine, theirs = peak_bytes(ours, device), peak_bytes(ref, device)
                memory = f"  peak memory {mine / 2**20:.1f} / {theirs / 2**20:.1f} MiB = {mine / theirs:.2f}"
            print(f"{device.type:4s} L={length:5d} H={args.heads}: maskcli {a * 1000:9.3f} ms  torch {b * 1000:9.3f} ms  "
                  f"ratio {mid:5.2f} (quartiles {low:.2f}-{high:.2f}; target <= {TARGET}) {verdict}{memory}")


if __name__ == "__main__":
    main()
