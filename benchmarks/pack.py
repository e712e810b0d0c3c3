"""`maskcli pack` at real sizes: 8 rows x 128k tokens, against references measured in the same run.

Each case is a packed batch of random document lengths (100 to 8,000 tokens) written as a
.safetensors file, and checked end to end in process (read, boundaries, every path's mask,
findings) as `maskcli pack FILE` does. The references: the bare boundary arithmetic
(np.diff over the position_ids and np.unique over cu_seqlens), and building the one
`document(sizes=[...])` mask of the same documents with maskcli and taking its intervals.
Machines here are shared and noisy: read the ratios (medians), not one time.

    python benchmarks/pack.py [--runs 3] [--rows 8] [--length 131072]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from maskcli.kinds.values import rows_text
from maskcli.mask import MaskOptions, build
from maskcli.pack.findings import check
from maskcli.sources import registry
from timing import timed  # noqa: E402  (benchmarks/timing.py, beside this script)


def batch(rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    positions = np.zeros((rows, length), dtype=np.int64)
    cu, sizes = [0], []
    for b in range(rows):
        p, row = 0, []
        while p < length:
            n = min(int(rng.integers(100, 8000)), length - p)
            positions[b, p : p + n] = np.arange(n)
            cu.append(b * length + p + n)
            row.append(n)
            p += n
        sizes.append(row)
    return {"position_ids": positions, "cu_seqlens": np.asarray(cu), "input_ids": rng.integers(3, 50000, (rows, length)), "sizes": sizes}



def save(path: Path, fields: dict[str, np.ndarray]) -> None:
    try:
        from safetensors.numpy import save_file  # only for writing the benchmark's file; maskcli reads it itself
    except ImportError:
        raise SystemExit("benchmarks/pack.py writes its batch with safetensors: pip install -e \".[test]\"") from None

    save_file({k: np.ascontiguousarray(v) for k, v in fields.items()}, str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=131072)
    args = parser.parse_args()
    data = batch(args.rows, args.length)
    sizes = data.pop("sizes")
    mask = np.ones((args.rows, args.length), dtype=np.int64)
    mask[:, -64:] = 0
    inside = mask.copy()
    inside[:, 5000:5016] = 0  # padding between samples: the paths' padding is then --ids, not --lengths
    cases = {
        "position_ids + cu_seqlens (fields agree)": dict(data),
        "+ attention_mask (HF ignores position_ids)": {**data, "attention_mask": mask},
        "+ attention_mask, padding inside rows": {**data, "attention_mask": inside},
        "+ position_ids that never restart": {**data, "position_ids": np.broadcast_to(np.arange(args.length), (args.rows, args.length))},
    }
    tokens = args.rows * args.length
    print(f"{args.rows} rows x {args.length:,} tokens ({tokens:,}), {sum(map(len, sizes)):,} documents, median of {args.runs} runs")

    def boundaries():
        starts = np.diff(data["position_ids"], axis=1) != 1
        return np.flatnonzero(starts), np.unique(data["cu_seqlens"])

    def one_document_mask():
        return build(f"document(sizes=[{rows_text(sizes)}])", MaskOptions()).intervals()

    bare = timed(boundaries, args.runs)
    document = timed(one_document_mask, args.runs)
    print(f"{'reference: np.diff + np.unique over the tokens':52s} {bare:7.3f} s")
    print(f"{'reference: maskcli document(sizes=...) intervals':52s} {document:7.3f} s")
    with tempfile.TemporaryDirectory() as folder:
        for name, fields in cases.items():
            path = Path(folder) / "batch.safetensors"
            save(path, fields)
            report = check(registry.read("packed", str(path), {}, []))  # as the command reads it; warm-up: imports
            mine = timed(lambda: check(registry.read("packed", str(path), {}, [])), args.runs)
            verdict = "ok" if report.ok else f"{len(report.findings)} findings"
            print(f"pack: {name:46s} {mine:7.3f} s  x{mine / bare:8.0f} the bare arithmetic  "
                  f"x{mine / document:5.1f} one document mask  ({verdict})")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
