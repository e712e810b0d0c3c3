"""Cost of reading K and V behind a softmax written by hand (trace/handkv.py), in the same run as the trace without it.

    python benchmarks/handkv.py [--prompt 128] [--steps 32] [--runs 9]

A decode loop of attention written by hand (q @ kᵀ, a float mask added, softmax, weights @ V), batch 2, 8 heads of
64, over a cache grown by torch.cat, one call a step, run three ways that alternate run by run: untraced, inside
`maskcli.trace()`, and inside it with q @ kᵀ's operands not kept (trace/scores.py's `keyed` replaced by a no-op: the
trace as it was before handkv.py). Two caches: the prompt's keys all nonzero (zerokv's first test, a few cells read,
ends it), and row 1's first 32 keys zero and masked (left padding whose K and V are zero: the run read from the edge,
each key's first dimension, then its ends whole). Printed per cache, by the CPU clock, medians of the runs: trace's cost
a call with and without the reading, the reading's own cost a call (with - without, median of the paired
differences), and traced / untraced with and without it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import maskcli
import maskcli.trace.scores as scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch, heads, dim = 2, 8, 64
    kept = scores.keyed

    def decode(padded: bool) -> None:
        k, v = torch.randn(batch, heads, args.prompt, dim), torch.randn(batch, heads, args.prompt, dim)
        mask = torch.zeros(batch, 1, 1, args.prompt)
        if padded:
            k[1, :, :32], v[1, :, :32] = 0, 0
            mask[1, ..., :32] = float("-inf")
        for _ in range(args.steps):
            k = torch.cat([k, torch.randn(batch, heads, 1, dim)], dim=2)
            v = torch.cat([v, torch.randn(batch, heads, 1, dim)], dim=2)
            mask = torch.cat([mask, torch.zeros(batch, 1, 1, 1)], dim=-1)
            q = torch.randn(batch, heads, 1, dim)
            weights = torch.softmax(q @ k.transpose(-2, -1) / dim ** 0.5 + mask, dim=-1)
            weights @ v

    def timed(padded: bool, mode: str) -> float:
        scores.keyed = kept if mode == "on" else (lambda *a: None)
        start = time.process_time()
        if mode == "plain":
            decode(padded)
        else:
            with maskcli.trace() as t:
                decode(padded)
            assert len(t.calls) == args.steps
        spent = time.process_time() - start
        scores.keyed = kept
        return spent

    for padded in (False, True):
        for mode in ("plain", "on", "off"):
            timed(padded, mode)  # (warm-up)
        runs = [{mode: timed(padded, mode) for mode in ("plain", "on", "off")} for _ in range(args.runs)]
        on = statistics.median((r["on"] - r["plain"]) / args.steps for r in runs)
        off = statistics.median((r["off"] - r["plain"]) / args.steps for r in runs)
        own = statistics.median((r["on"] - r["off"]) / args.steps for r in runs)
        ratio_on = statistics.median(r["on"] / r["plain"] for r in runs)
        ratio_off = statistics.median(r["off"] / r["plain"] for r in runs)
        what = "row 1's first 32 keys zero and masked" if padded else "every key nonzero"
        print(f"{what}: trace's cost a call {on * 1e3:.3f} ms with the reading, {off * 1e3:.3f} ms without; the reading "
              f"{own * 1e3:.3f} ms a call; traced / untraced {ratio_on:.2f}x with, {ratio_off:.2f}x without "
              f"({args.runs} runs, {args.steps} calls each, CPU clock)")


if __name__ == "__main__":
    main()
