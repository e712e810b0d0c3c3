"""Cost of `maskcli model` per family: building the tiny model, and its generate traced against untraced, in one run.

    python benchmarks/model.py [--runs 7] [--families llama,mistral,gemma3_text,qwen3,llama4_text] [--attn sdpa]

Each family is built from its config class shrunk as `maskcli model` shrinks it (its window or chunk size set to 3,
so that the masks have structure), then the same padded batch (lengths 5,3, 2 decode steps) is generated with the
same model untraced and inside maskcli's trace, alternately, so that a slow spell on a shared machine hits both.
It prints per family the median build time and the median traced and untraced generate times (CPU time of this
process, steadier than the wall clock where other programs share the cores) with the median of the paired ratios.
Needs transformers (the hf extra); downloads nothing.
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
    args = parser.parse_args()

    import torch

    from maskcli.hf import quiet
    from maskcli.hf.families import load, tiny
    from maskcli.hf.run import _generate, build, prompt

    torch.set_num_threads(1)
    print(f"{'family':14s} {'build s':>8s} {'untraced s':>11s} {'traced s':>9s} {'ratio':>6s}  (medians of {args.runs}, CPU time)")
    for family in args.families.split(","):
        config = load(family)
        sizes = {"window": 3} if hasattr(config, "sliding_window") else {"chunk_size": 3} if hasattr(config, "attention_chunk_size") else {}
        config = tiny(config, name=family, **sizes)
        batch = prompt((5, 3), None, config.pad_token_id, "left", 128)
        options = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=batch.pad_id, cache_implementation="dynamic")
        builds, plain, traced, ratios = [], [], [], []
        for _ in range(args.runs):
            started = time.process_time()
            model = build(config, args.attn, family)
            builds.append(time.process_time() - started)
            started = time.process_time()
            with quiet(), torch.no_grad():
                model.generate(batch.ids, attention_mask=batch.attention_mask, **options)
            plain.append(time.process_time() - started)
            started = time.process_time()
            _generate(model, batch, options, args.attn, "dynamic", family, None)
            traced.append(time.process_time() - started)
            ratios.append(traced[-1] / plain[-1])
        print(f"{family:14s} {statistics.median(builds):8.3f} {statistics.median(plain):11.3f} {statistics.median(traced):9.3f} "
              f"{statistics.median(ratios):6.2f}")


if __name__ == "__main__":
    main()
