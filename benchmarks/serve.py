"""`maskcli serve` at serving size: 256 requests x 32k keys in 16-token pages, read, checked and summarised.

The batch is vLLM's CommonAttentionMetadata of a decode step (one new token per request, 2,048
blocks each, half of every table a shared prefix), written as a .safetensors file and taken end
to end in process as `maskcli serve FILE` does: read the file, build the batch, every rule, the
page map and the rows the views print (the terminal text rendered to a string). The reference:
numpy reading the same arrays (safetensors.numpy.load_file) with the slot arithmetic a reader
does anyway, and the same reading plus one sort of every table entry (the least a check of
shared pages does).
The target is 2 s; shared machines are noisy: read the medians and ratios, not one time.
Then --many one-token requests (3 keys on one page each), the same way: serve is O(requests + pages), so
10^6 of them take seconds (each request's lengths were once diffed from the whole indptr: quadratic).
Then --masks requests of a prefill step (each 64 new tokens after 960 cached, window(512)): every request's Mask
(what --html, --expect and the positions rule ask for, request by request), the same with its intervals, and the
whole `--expect "*=window(512)"` check (mostly diff's comparison of intervals). Each Mask is made from the request's
kinds at its positions; it was once written as an expression and parsed back.

    python benchmarks/serve.py [--runs 3] [--requests 256] [--keys 32768] [--page 16] [--many 1000000] [--masks 2000]
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import numpy as np

from timing import timed  # noqa: E402  (benchmarks/timing.py, beside this script)


def batch(requests: int, keys: int, page: int) -> dict[str, np.ndarray]:
    blocks = -(-keys // page)
    shared = np.arange(1, blocks // 2 + 1)  # a prefix every request shares (full pages of the prefix cache)
    own = np.arange(requests * (blocks - shared.size)).reshape(requests, -1) + shared.size + 1
    table = np.concatenate([np.broadcast_to(shared, (requests, shared.size)), own], 1)
    seq = np.full(requests, keys - 5)  # the last page part filled
    positions = seq - 1
    slots = table[np.arange(requests), positions // page] * page + positions % page
    return {"query_start_loc": np.arange(requests + 1), "seq_lens": seq, "num_computed_tokens_cpu": seq - 1,
            "block_table_tensor": np.ascontiguousarray(table), "slot_mapping": slots, "block_size": np.array(page),
            "positions": positions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--many", type=int, default=1_000_000)
    parser.add_argument("--masks", type=int, default=2000)
    args = parser.parse_args()
    from safetensors.numpy import load_file, save_file  # the reference reader, and the benchmark's writer

    from maskcli.checks.pagemap import page_map
    from maskcli.checks.serve import check
    from maskcli.render import serve as render
    from maskcli.serve.engines import read

    fields = batch(args.requests, args.keys, args.page)
    print(f"{args.requests} requests x {args.keys:,} keys, pages of {args.page}: "
          f"{fields['block_table_tensor'].size:,} table entries, median of {args.runs} runs")
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "batch.safetensors")
        save_file(fields, path)

        def reference():
            arrays = load_file(path)
            table, seq = arrays["block_table_tensor"], arrays["seq_lens"]
            pos = seq - 1
            return table[np.arange(len(seq)), pos // args.page] * args.page + pos % args.page

        def serve(path=path):
            from rich.console import Console

            b = read(path)
            findings = check(b)
            rows = render.request_rows(b, page_map(b), render.TABLE_REQUESTS)  # as the command's tables do
            console = Console(file=io.StringIO(), width=120)
            for view in render.views(b, rows, findings, path, "vLLM", 120):
                console.print(view)
            return findings

        def sort_pages():  # the least any check of shared pages does: one sort of every table entry
            return np.sort(load_file(path)["block_table_tensor"], axis=None)

        findings = serve()  # warm-up: imports
        bare = timed(reference, args.runs)
        sort = timed(sort_pages, args.runs)
        mine = timed(serve, args.runs)
        many = str(Path(folder) / "many.safetensors")
        r = args.many
        save_file({"query_start_loc": np.arange(r + 1), "seq_lens": np.full(r, 3), "num_computed_tokens_cpu": np.full(r, 2),
                   "block_table_tensor": np.arange(1, r + 1)[:, None], "slot_mapping": np.arange(1, r + 1) * 4 + 2,
                   "block_size": np.array(4)}, many)
        crowd = timed(lambda: serve(many), 1)
        from maskcli.checks.serveexpect import expect
        from maskcli.serve.engines import from_tensors

        m = args.masks
        prefill = from_tensors({"query_start_loc": np.arange(m + 1) * 64, "seq_lens": np.full(m, 1024),
                                "num_computed_tokens_cpu": np.full(m, 960), "sliding_window": np.array(512)}, "prefill")

        made = timed(lambda: [prefill.mask(r) for r in range(m)], args.runs)
        spans = timed(lambda: [prefill.mask(r).intervals() for r in range(m)], args.runs)
        expected = timed(lambda: expect(prefill, [("*", "window(512)")]), args.runs)
        held = expect(prefill, [("*", "window(512)")])[0].severity == "note"
    print(f"{'reference: numpy reads the arrays + the slot arithmetic':58s} {bare:7.3f} s")
    print(f"{'reference: numpy reads the table and sorts its entries':58s} {sort:7.3f} s")
    print(f"{'serve: read, every rule, page map, the printed summary':58s} {mine:7.3f} s  x{mine / bare:6.0f} the reading  "
          f"x{mine / sort:5.1f} the sort  ({'no findings' if not findings else f'{len(findings)} findings'}; target 2 s)")
    print(f"{f'serve: {args.many:,} one-token requests, the same way':58s} {crowd:7.3f} s")
    print(f"{f'{args.masks:,} requests: every Mask':58s} {made:7.3f} s")
    print(f"{f'{args.masks:,} requests: every Mask and its intervals':58s} {spans:7.3f} s")
    print(f"{f'{args.masks:,} requests: --expect *=window(512)':58s} {expected:7.3f} s  ({'holds' if held else 'differs'})")


if __name__ == "__main__":
    main()
