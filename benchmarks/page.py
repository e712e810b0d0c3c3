"""Size and load time of --html pages at long lengths, in the system's chromium (Playwright, no browser download).

    python benchmarks/page.py [--runs 5] [--chromium /usr/bin/chromium] [--window 1500x1100]

For each mask it builds the page (Python: build + intervals + runs + HTML, median seconds), writes it, and loads it
in headless chromium `--runs` times, reading the time from navigation start to the page's first drawn frame
(window.__maskcliFirstDraw, set after the canvas is painted; it includes parsing the data and one exact pass over
every row at the whole-mask zoom). As a reference measured in the same run, it loads a blank page of the same size
(the same bytes in an HTML comment, no script), so the ratio says what the drawing costs beyond reading the file.
The page sizes its canvas to the window (--window), so the drawing's cost grows with the window's area.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from maskcli import build
from maskcli.render.html import mask_page

MASKS = [  # (name, keywords for maskcli.build)
    ("document(sizes=[300000,400000,348576]) & window(4096)", {}),
    ("causal & (window(4096) | sink(4))", {"length": 1 << 20}),
    ("local(8192)", {"length": 1 << 20}),
    ("causal", {"length": 1 << 17, "lengths": [131072, 100000, 65536]}),
    ("local(2)", {"length": 1 << 20}),  # rows alternate: no affine runs, so rows are sampled to stay small
    ("document & window(4096)", {"sizes": [2] * (1 << 19)}),  # 524,288 documents: the worst for runs and labels
]


def load_ms(page, path: Path, ready: str) -> float:
    page.goto(path.as_uri())
    page.wait_for_function(ready, timeout=120_000)
    return page.evaluate("window.__maskcliFirstDraw ?? performance.now()")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--window", default="1500x1100", help="the browser window, WIDTHxHEIGHT (the canvas fits it)")
    args = parser.parse_args()
    width, height = (int(side) for side in args.window.split("x"))
    from playwright.sync_api import sync_playwright

    folder = Path(tempfile.mkdtemp())
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": height})
        print(f"{'mask':58} {'file MB':>8} {'build s':>8} {'first draw ms':>14} {'blank ms':>9} {'ratio':>6}")
        for text, options in MASKS:
            builds = []
            for _ in range(3):
                start = time.perf_counter()
                html = mask_page(build(text, **options))
                builds.append(time.perf_counter() - start)
            path, blank = folder / "page.html", folder / "blank.html"
            path.write_text(html)
            blank.write_text("<!DOCTYPE html><body><!--" + "x" * len(html) + "--><script>window.__maskcliFirstDraw = performance.now()</script>")
            drawn = [load_ms(page, path, "window.__maskcliFirstDraw !== undefined") for _ in range(args.runs)]
            bare = [load_ms(page, blank, "window.__maskcliFirstDraw !== undefined") for _ in range(args.runs)]
            name = text + "".join(f" {key}={str(value)[:12]}" for key, value in options.items())
            print(f"{name[:58]:58} {path.stat().st_size / 1e6:8.3f} {statistics.median(builds):8.2f} "
                  f"{statistics.median(drawn):14.0f} {statistics.median(bare):9.0f} {statistics.median(drawn) / statistics.median(bare):6.1f}")
        browser.close()


if __name__ == "__main__":
    main()
