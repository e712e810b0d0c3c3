"""Start-up cost of maskcli against the torch import it cannot avoid, measured in one run.

    python benchmarks/startup.py [--runs 7]

Prints the median wall time of each command and the ratios
  show causal --len 6  /  python -c "import torch"     (target <= 0.25)
  maskcli --help       /  python -c "pass"             (no torch, no matplotlib)
Medians of interleaved runs, since the machines here are shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "maskcli show causal --len 6": [sys.executable, "-m", "maskcli", "show", "causal", "--len", "6"],
    "python -c pass": [sys.executable, "-c", "pass"],
    "maskcli --help": [sys.executable, "-m", "maskcli", "--help"],
}


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    for command in COMMANDS.values():  # warm the file cache once
        timed(command)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, command in COMMANDS.items():  # interleaved, so drift hits every command alike
            times[name].append(timed(command))
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
        print(f"{name:32s} median {value * 1000:8.1f} ms over {args.runs} runs")
    show_ratio = median["maskcli show causal --len 6"] / median["import torch"]
    help_ratio = median["maskcli --help"] / median["python -c pass"]
    print(f"ratio show / import torch: {show_ratio:.2f}  (target <= 0.25) {'OK' if show_ratio <= 0.25 else 'OVER'}")
    print(f"ratio --help / bare python: {help_ratio:.2f}  (--help loads neither torch nor matplotlib)")


if __name__ == "__main__":
    main()
