"""Reading a mask file without torch: show, inspect and diff of .npy/.npz/.safetensors/.json against `import torch`.

    python benchmarks/mask_files.py [--runs 7] [--len 512]

Writes one mask (window(128) over --len positions) as each file type in a temporary folder,
then prints the median wall time of each command and its ratio to `python -c "import torch"`,
measured in the same run, interleaved (the machines here are shared and noisy). A .pt file
still needs torch: its line is there to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def write_files(folder: Path, length: int) -> None:
    """window(128) as keep (.npy), int 0/1 (.npz), bfloat16 finfo.min (.safetensors), additive (.json), keep (.pt)."""
    q, k = np.arange(length)[:, None], np.arange(length)[None, :]
    keep = (k <= q) & (k > q - 128)
    np.save(folder / "m.npy", keep)
    np.savez(folder / "m.npz", mask=keep.astype(np.int64))
    fill = np.float32(-3.3895313892515355e38)  # finfo(bfloat16).min, exact in float32: bfloat16 is its top half
    raw = (np.where(keep, np.float32(0), fill).view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"attention_mask": {"dtype": "BF16", "shape": [length, length], "data_offsets": [0, len(raw)]}}).encode()
    (folder / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw)
    (folder / "m.json").write_text(json.dumps([[0 if seen else "-inf" for seen in row] for row in keep.tolist()]))
    subprocess.run([sys.executable, "-c", f"import numpy, torch; torch.save(torch.from_numpy(numpy.load('{folder / 'm.npy'}')), '{folder / 'm.pt'}')"], check=True)


def commands() -> dict[str, list[str]]:
    maskcli = [sys.executable, "-m", "maskcli"]
    return {
        "import torch": [sys.executable, "-c", "import torch"],
        "show --mask m.npy": [*maskcli, "show", "--mask", "m.npy"],
        "show --mask m.npz --summary": [*maskcli, "show", "--mask", "m.npz", "--summary"],
        "inspect m.safetensors": [*maskcli, "inspect", "m.safetensors"],
        "inspect m.json --json": [*maskcli, "inspect", "m.json", "--json"],
        "diff m.safetensors window(128)": [*maskcli, "diff", "m.safetensors", "window(128)"],
        "diff m.npy m.json": [*maskcli, "diff", "m.npy", "m.json"],
        "inspect m.pt (needs torch)": [*maskcli, "inspect", "m.pt"],
    }


def timed(command: list[str], folder: Path) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=folder, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--len", type=int, default=512, dest="length")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        write_files(folder, args.length)
        runs = commands()
        for command in runs.values():  # warm the file cache once
            timed(command, folder)
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(args.runs):
            for label, command in runs.items():  # interleaved, so drift hits every command alike
                times[label].append(timed(command, folder))
    median = {label: statistics.median(values) for label, values in times.items()}
    torch_time = median["import torch"]
    print(f"mask of {args.length} x {args.length}, medians of {args.runs} runs")
    for label, value in median.items():
        ratio = "" if label == "import torch" else f"   {value / torch_time:5.2f} x import torch"
        print(f"{label:34s} {value * 1000:8.1f} ms{ratio}")


if __name__ == "__main__":
    main()
