"""Reading a JSON mask file: maskcli's reader against numpy.load of the same mask as .npy, in the same run.

    python benchmarks/json_masks.py [--runs 5] [--len 4096]

Writes window(128) over --len positions as a 0/1 JSON file (4096: 33 MB, the size a user's tutorial mask
reaches), as an additive JSON file ("-inf" strings, maskcli's spelling of minus infinity) and as .npy, then
prints the median time of maskcli.tensorfile.read_tensors on each JSON file, of Python's own json.loads of
the same text (the C parser alone, no array made), and their ratios to numpy.load of the .npy, measured
interleaved in one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maskcli.tensorfile import read_tensors  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--len", type=int, default=4096, dest="length")
    args = parser.parse_args()
    q, k = np.arange(args.length)[:, None], np.arange(args.length)[None, :]
    keep = (k <= q) & (k > q - 128)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        np.save(folder / "m.npy", keep.astype(np.int64))
        (folder / "int.json").write_text(json.dumps(keep.astype(int).tolist(), separators=(",", ":")))
        (folder / "additive.json").write_text(json.dumps(np.where(keep, 0, None).tolist()).replace("null", '"-inf"'))
        runs = {
            "numpy.load m.npy": lambda: np.load(folder / "m.npy"),
            "json.loads int.json (no array)": lambda: json.loads((folder / "int.json").read_text()),
            "maskcli int.json": lambda: read_tensors(str(folder / "int.json"), "--mask"),
            "maskcli additive.json": lambda: read_tensors(str(folder / "additive.json"), "--mask"),
        }
        got = read_tensors(str(folder / "additive.json"), "--mask")[""]
        assert np.array_equal(got == 0, keep) and np.all(np.isneginf(got[~keep]))  # what is timed reads right
        assert np.array_equal(read_tensors(str(folder / "int.json"), "--mask")[""], keep.astype(np.int64))
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(args.runs):
            for label, run in runs.items():  # interleaved, so drift hits every reader alike
                start = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - start)
        sizes = {"int.json": (folder / "int.json").stat().st_size, "additive.json": (folder / "additive.json").stat().st_size}
    median = {label: statistics.median(values) for label, values in times.items()}
    reference = median["numpy.load m.npy"]
    print(f"window(128) over {args.length} x {args.length} (int.json {sizes['int.json'] / 1e6:.0f} MB, "
          f"additive.json {sizes['additive.json'] / 1e6:.0f} MB), medians of {args.runs} runs")
    for label, value in median.items():
        print(f"{label:32s} {value * 1000:9.1f} ms   {value / reference:7.1f} x numpy.load")


if __name__ == "__main__":
    main()
