"""The checks' false alarms on programs maskcli did not write: every family `maskcli model --list` lists, built tiny and
run as `maskcli model FAMILY` runs it (a left-padded batch, a prefill and decode steps under generate), sdpa and eager,
with a dynamic and a static cache (`--cache static`: a full layer's empty slots, a sliding layer's until it fills);
a correct family must get no wrong finding. Not a timing: run once, by hand (minutes), and read its last line.

    python benchmarks/false_alarms.py [FAMILY ...]
"""

from __future__ import annotations

import sys
import time


def main(names: list[str]) -> int:
    from maskcli.checks.registry import severity
    from maskcli.errors import MaskError
    from maskcli.hf.families import default_config, names as families, tiny
    from maskcli.hf.report import view
    from maskcli.hf.run import prompt, run

    chosen = names or list(families())
    ran = alarms = 0
    started = time.perf_counter()
    for name in chosen:
        for attn, cache in ((attn, cache) for attn in ("sdpa", "eager") for cache in ("dynamic", "static")):
            try:
                config = tiny(default_config(name), name=name)
                batch = prompt((5, 3), None, config.pad_token_id if 0 <= (config.pad_token_id or 0) < 128 else 0, "left", 128)
                result = run(name, config, batch, new_tokens=2, attn=attn, cache=cache)
            except MaskError as error:
                print(f"{name} {attn} {cache}: not run ({str(error)[:80]})", flush=True)
                continue
            ran += 1
            wrong = [f for group in view(result).groups for f in group.findings if severity(f) == "wrong"]
            if wrong:
                alarms += 1
                print(f"{name} {attn} {cache}: {len(wrong)} wrong: {wrong[0].code}: {wrong[0].message[:160]}", flush=True)
    print(f"{ran} runs of {len(chosen)} families, {alarms} with a wrong finding, {time.perf_counter() - started:.0f} s")
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
