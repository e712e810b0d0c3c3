"""maskcli export at 1,048,576 tokens, measured in one run: the O(L) formats and their round trips, against a reference.

Each command runs in a fresh process (as a user runs it), several times; the median wall
time and the largest peak memory (max RSS) are printed, with the ratio to the reference
measured in the same run: `maskcli show EXPR --summary` on the same mask (the intervals
and one pass over them, which every export starts from) plus `python -c "import torch"`
(writing and reading .pt files needs torch, which show --summary never imports).

  export EXPR --for flash-attn|flashmask|magi --save FILE      targets: <= 3 x the reference time, <= 1 GiB
  diff EXPR FILE --from FORMAT (the round trip, exit 0)        targets: <= 4 x the reference time, <= 1.5 GiB
  export EXPR --compare                                        target: <= 3 x the reference time

Machines here are shared and noisy: read the medians and ratios, not one time.

    python benchmarks/export.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from long_masks import measure, mib  # noqa: E402  (the same timing in fresh processes)

N = 1 << 20
TEXT = f"document(sizes=[{','.join(['4096'] * 256)}]) & window(1024)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "COLUMNS": "100"}
    maskcli = [sys.executable, "-m", "maskcli"]
    summary, base_memory = measure([*maskcli, "show", TEXT, "--summary"], args.runs, env)
    torch_import, _ = measure([sys.executable, "-c", "import torch"], args.runs, env)
    base = summary + torch_import
    print(f"reference: show --summary at {N:,} tokens (256 documents, window 1024) {summary:.2f} s, {mib(base_memory)}, "
          f"+ import torch {torch_import:.2f} s = {base:.2f} s; {args.runs} runs each, median wall, peak RSS")
    folder = tempfile.mkdtemp()
    for fmt in ("flash-attn", "flashmask", "magi"):
        path = os.path.join(folder, f"{fmt}.pt")
        wall, memory = measure([*maskcli, "export", TEXT, "--for", fmt, "--save", path], args.runs, env)
        verdict = "OK" if wall <= 3 * base and memory <= 2**30 else "OVER"
        print(f"export --for {fmt:10s} {wall:6.2f} s {mib(memory)}  x{wall / base:4.1f} time {verdict}")
        wall, memory = measure([*maskcli, "diff", TEXT, path, "--from", fmt], args.runs, env)
        verdict = "OK" if wall <= 4 * base and memory <= 1.5 * 2**30 else "OVER"
        print(f"diff --from {fmt:11s} {wall:6.2f} s {mib(memory)}  x{wall / base:4.1f} time {verdict}")
    wall, memory = measure([*maskcli, "export", TEXT, "--compare"], args.runs, env)
    print(f"export --compare        {wall:6.2f} s {mib(memory)}  x{wall / base:4.1f} time {'OK' if wall <= 3 * base else 'OVER'}")


if __name__ == "__main__":
    main()
