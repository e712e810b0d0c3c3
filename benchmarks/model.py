"""Cost of `maskcli model` per family: building the tiny model, and its generate traced against untraced, in one run.

    python benchmarks/model.py [--runs 7] [--families llama,mistral,gemma3_text,qwen3,llama4_text] [--attn sdpa]
                               [--lengths 5,3] [--new-tokens 2] [--cache dynamic]

Each family is built from its config class shrunk as `maskcli model` shrinks it (its window or chunk size set to 3,
so that the masks have structure), then the same padded batch (lengths 5,3, 2 decode steps) is generated with the
same model untraced, inside maskcli's trace (with its cache watch, as `maskcli model` runs it), and under the cache
watch alone (maskcli.hf.cache.Watch: what reading each layer's keys off its cache costs), in turn, so that a slow
spell on a shared machine hits all three. It prints per family the median build time and the median generate
times (CPU time of this process, steadier than the wall clock where other programs share the cores) with the
medians of the paired ratios to untraced. Needs transformers (the hf extra); downloads nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--families", default="llama,mistral,gemma3_text,qwen3,llama4_text")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--lengths", default="5,3")
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--cache", default="dynamic", choices=("dynamic", "static"))
    args = parser.parse_args()

    import torch

    from maskcli.hf import quiet
    from maskcli.hf.cache import Watch
    from maskcli.hf.families import load, tiny
    from maskcli.hf.run import _generate, build, prompt

    torch.set_num_threads(1)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    print(f"lengths {args.lengths}, {args.new_tokens} decode steps, --cache {args.cache}, --attn {args.attn}")
    print(f"{'family':14s} {'build s':>8s} {'untraced s':>11s} {'traced s':>9s} {'ratio':>6s} {'watch s':>8s} {'ratio':>6s}"
          f"  (medians of {args.runs}, CPU time)")
    for family in args.families.split(","):
        config = load(family)
        sizes = {"window": 3} if hasattr(config, "sliding_window") else {"chunk_size": 3} if hasattr(config, "attention_chunk_size") else {}
        config = tiny(config, name=family, **sizes)
        batch = prompt(lengths, None, config.pad_token_id, "left", 128)
        options = dict(max_new_tokens=args.new_tokens + 1, min_new_tokens=args.new_tokens + 1, do_sample=False,
                       pad_token_id=batch.pad_id, cache_implementation=args.cache)
        builds, plain, traced, ratios, watched, watch_ratios = [], [], [], [], [], []
        for _ in range(args.runs):
            started = time.process_time()
            model = build(config, args.attn, family)
            builds.append(time.process_time() - started)
            started = time.process_time()
            with quiet(), torch.no_grad():
                model.generate(batch.ids, attention_mask=batch.attention_mask, **options)
            plain.append(time.process_time() - started)
            started = time.process_time()
            _generate(model, batch, options, args.attn, args.cache, family, None)
            traced.append(time.process_time() - started)
            ratios.append(traced[-1] / plain[-1])
            started = time.process_time()
            with quiet(), torch.no_grad(), Watch():
                model.generate(batch.ids, attention_mask=batch.attention_mask, **options)
            watched.append(time.process_time() - started)
            watch_ratios.append(watched[-1] / plain[-1])
        print(f"{family:14s} {statistics.median(builds):8.3f} {statistics.median(plain):11.3f} {statistics.median(traced):9.3f} "
              f"{statistics.median(ratios):6.2f} {statistics.median(watched):8.3f} {statistics.median(watch_ratios):6.2f}")


if __name__ == "__main__":
    main()
