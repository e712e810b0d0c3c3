"""Cost of `maskcli trace` on a program: a small decoder run traced and untraced, in the same run, on the CPU.

    python benchmarks/trace.py [--runs 15] [--len 128] [--steps 8] [--layers 4]

The program is maskcli.trace.demo's decoder (random weights): a batch of 2 prompts with
left padding, prefill then --steps decode steps with a KV cache, every layer calling SDPA
with a sliding-window mask (the model builds the mask once per step and hands it to every
layer, as decoders do). Traced means inside `maskcli.trace()`: the TorchFunctionMode sees
every torch call, module hooks run for every module, and each step's mask is read and stored.
The two sides alternate run by run, so a slow spell on a shared machine hits both; it prints
the median seconds of each and the median of the paired ratios with quartiles (target <= 1.5).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import maskcli
from maskcli.trace.demo import Decoder, window_mask

TARGET = 1.5


def generate(model, ids, steps: int, window: int) -> None:
    real = ids != 0
    caches = [[] for _ in model.layers]
    with torch.no_grad():
        logits = model(ids, window_mask(real, ids.shape[1], window), caches)
        for _ in range(steps):
            token = logits[:, -1].argmax(-1, keepdim=True)
            real = torch.cat([real, torch.ones_like(token, dtype=torch.bool)], dim=1)
            logits = model(token, window_mask(real, 1, window), caches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--window", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Decoder(vocab=1000, dim=256, heads=4, layers=args.layers).eval()
    ids = torch.randint(1, 1000, (2, args.len))
    ids[1, : args.len // 4] = 0

    def plain() -> float:
        start = time.perf_counter()
        generate(model, ids, args.steps, args.window)
        return time.perf_counter() - start

    def traced() -> float:
        start = time.perf_counter()
        with maskcli.trace() as t:
            generate(model, ids, args.steps, args.window)
        elapsed = time.perf_counter() - start
        assert len(t.calls) == args.layers * (args.steps + 1)
        return elapsed

    plain(), traced()  # warm-up: first calls allocate and import
    untraced_times, traced_times, ratios = [], [], []
    for _ in range(args.runs):
        a, b = plain(), traced()
        untraced_times.append(a)
        traced_times.append(b)
        ratios.append(b / a)
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    print(f"decoder: {args.layers} layers, batch 2, prompt {args.len}, {args.steps} decode steps, {args.runs} runs, "
          f"{torch.get_num_threads()} threads")
    print(f"untraced median {statistics.median(untraced_times) * 1e3:.1f} ms, traced median {statistics.median(traced_times) * 1e3:.1f} ms")
    print(f"traced / untraced: median {median:.2f}x (quartiles {q1:.2f}-{q3:.2f}), target <= {TARGET}x: "
          f"{'met' if median <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
