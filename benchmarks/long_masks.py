"""Long masks, measured in one run: exact summaries, maps and block views at 1M tokens, against references.

Each maskcli command runs in a fresh process (as a user runs it), several times; the
median wall time and the largest peak memory (max RSS of that process) are printed, with
the ratio to a reference measured in the same run:

  show EXPR --summary / the exact map, every kind at 1,048,576 tokens
      targets: <= 2 s wall, <= 1 GiB; reference: python -c "import numpy" (the start-up any run pays)
  blocks EXPR --block 128 at 1,048,576 tokens
      targets: <= 3 s wall, <= 1.5 GiB; beside eager create_block_mask at 16,384 tokens
      on the same mask (time per block, and its peak memory)
  show "window(3) & window(3) & ..." --summary, 1,000 and 10,000 terms at 1,048,576 tokens
      against a single window(3) in the same run (repeats are folded once: the ratio stays near 1)
  exact counting cell by cell (labels that go down), 8,192 tokens
      cells per second, beside create_mask(mask_mod, ...).sum() on the same predicate

Machines here are shared and noisy: read the medians and ratios, not one time.

    python benchmarks/long_masks.py [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

N = 1 << 20
SIZES = ",".join(["4096"] * 256)
KINDS = [
    ("full", []),
    ("causal", []),
    ("window(4096)", []),
    ("prefix(4096)", []),
    ("causal & (window(4096) | sink(4))", []),
    ("local(8192)", []),
    (f"chunk(sizes=[{SIZES}])", []),
    (f"document(sizes=[{SIZES}]) & window(4096)", []),
    (f"segment(sizes=[{SIZES}])", []),
    ('causal | blocks("{ids}")', []),  # 256 images of 1,024 tokens between text (Gemma 3), ids from a file
    ("tril(-5)", []),
    ("triu(1)", []),
    ("causal", ["--lengths", f"{N},{N // 2}"]),
    ("tree(-1,0,0,1,1,2,3,3)", ["--offset", str(N - 8)]),  # a draft tree behind a 1M-token cache
]


def image_ids(folder: str) -> str:
    """A .npy of block ids: 256 images of 1,024 tokens, -1 (text) between them, over 1,048,576 positions."""
    import numpy as np

    ids = np.full(N, -1, dtype=np.int64)
    for image in range(256):
        start = image * 4096 + 1024
        ids[start : start + 1024] = image
    path = os.path.join(folder, "image_ids.npy")
    np.save(path, ids)
    return path


def run(args: list[str], env=None) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{process.stderr.read().decode()[-800:]}")
    return wall, usage.ru_maxrss * 1024


def measure(args: list[str], runs: int, env=None) -> tuple[float, int]:
    results = [run(args, env) for _ in range(runs)]
    return statistics.median(r[0] for r in results), max(r[1] for r in results)


def mib(count: int) -> str:
    return f"{count / 2**20:7.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="three kinds only")
    args = parser.parse_args()
    env = {**os.environ, "COLUMNS": "100"}
    maskcli = [sys.executable, "-m", "maskcli"]
    base, base_memory = measure([sys.executable, "-c", "import numpy"], args.runs)
    print(f"reference python -c 'import numpy': {base:.3f} s, {mib(base_memory)}; {args.runs} runs each, median wall, peak RSS")
    print(f"{'show at 1,048,576 tokens':58s} {'summary':>8s} {'map':>8s} {'peak':>11s}  vs reference")
    import tempfile

    folder = tempfile.mkdtemp()
    for text, extra in KINDS[:3] if args.quick else KINDS:
        text = text.replace("{ids}", image_ids(folder)) if "{ids}" in text else text
        length = [] if "sizes" in text or "ids" in text or "tree" in text else ["--len", str(N)]
        summary, summary_memory = measure([*maskcli, "show", text, *length, *extra, "--summary"], args.runs, env)
        mapped, map_memory = measure([*maskcli, "show", text, *length, *extra], args.runs, env)
        worst, memory = max(summary, mapped), max(summary_memory, map_memory)
        verdict = "OK" if worst <= 2 and memory <= 2**30 else "OVER"
        shown = (text if len(text) < 44 else text[:30] + "..." + text[-10:]) + (" " + " ".join(extra)[:12] if extra else "")
        print(f"{shown:58s} {summary:7.2f}s {mapped:7.2f}s {mib(memory)}  x{worst / base:4.1f} time {verdict}")

    print()
    single, _ = measure([*maskcli, "show", "window(3)", "--len", str(N), "--summary"], args.runs, env)
    for terms in (1_000, 10_000):
        chain = " & ".join(["window(3)"] * terms)
        chained, _ = measure([*maskcli, "show", chain, "--len", str(N), "--summary"], args.runs, env)
        print(f"window(3) & ... {terms:,} terms at 1,048,576 tokens, --summary: {chained:.2f} s; "
              f"window(3) alone {single:.2f} s; ratio {chained / single:.2f}")

    print()
    text = f"document(sizes=[{SIZES}]) & window(4096)"
    blocks, blocks_memory = measure([*maskcli, "blocks", text, "--block", "128"], args.runs, env)
    verdict = "OK" if blocks <= 3 and blocks_memory <= 1.5 * 2**30 else "OVER"
    print(f"blocks {text[:40]}... at 1,048,576 tokens, block 128: {blocks:.2f} s, {mib(blocks_memory)} {verdict}")
    small = 1 << 14
    small_sizes = ",".join(["4096"] * (small // 4096))
    eager_code = (
        "import time, torch\nfrom torch.nn.attention.flex_attention import create_block_mask\n"
        "from maskcli.mask import build\n"
        f"m = build('document(sizes=[{small_sizes}]) & window(4096)')\n"
        "start = time.perf_counter()\n"
        f"create_block_mask(m.mask_mod, None, None, {small}, {small}, device='cpu')\n"
        "print(time.perf_counter() - start)\n"
    )
    times = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", eager_code], capture_output=True, text=True, check=True)
        times.append(float(out.stdout.strip()))
    _, eager_memory = run([sys.executable, "-c", eager_code])
    eager = statistics.median(times)
    ours_per_block = blocks / (N // 128) ** 2
    eager_per_block = eager / (small // 128) ** 2
    print(f"eager create_block_mask at {small:,} tokens on the same mask: {eager:.2f} s, {mib(eager_memory)} "
          f"(time per block: maskcli at 1M / eager at 16k = {ours_per_block / eager_per_block:.4f})")

    print()
    count_code = (
        "import time, numpy as np, torch\nfrom torch.nn.attention.flex_attention import create_mask\n"
        "from maskcli.mask import build\nfrom maskcli.summary import summarise\n"
        "labels = ','.join(str(v) for v in ([0, 2, 1] * 2731)[:8192])\n"
        "m = build(f'chunk({labels})')\nassert not m.exact\n"
        "ours, theirs = [], []\n"
        f"for _ in range({args.runs}):\n"
        "    s = time.perf_counter(); a = summarise(m).visible; ours.append(time.perf_counter() - s)\n"
        "    s = time.perf_counter(); b = int(create_mask(m.mask_mod, 1, 1, 8192, 8192, device='cpu').sum()); theirs.append(time.perf_counter() - s)\n"
        "    assert a == b, (a, b)\n"
        "print(np.median(ours), np.median(theirs))\n"
    )
    out = subprocess.run([sys.executable, "-c", count_code], capture_output=True, text=True, check=True)
    ours, theirs = map(float, out.stdout.split())
    cells = 8192 * 8192
    print(f"exact counting cell by cell at 8,192 tokens (labels that go down): {cells / ours / 1e6:.0f} M cells/s; "
          f"create_mask(...).sum() {cells / theirs / 1e6:.0f} M cells/s; ratio of times {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
