"""The checks' false alarms on programs maskcli did not write: every family `maskcli model --list` lists, built tiny and
run as `maskcli model FAMILY` runs it (a left-padded batch, a prefill and decode steps under generate), sdpa and eager,
with a dynamic and a static cache (`--cache static`: a full layer's empty slots, a sliding layer's until it fills);
a correct family must get no wrong finding. Not a timing: run once, by hand (minutes), and read its last line.

A `padding-ignored` finding (and the rows it leaves blind) is checked here independently of the checks: every forward `generate` makes is
watched (the model's own `prepare_inputs_for_generation`), and where none of them was handed the batch's
`attention_mask` (XLNet and XLM drop it: their forwards build masks from the ids alone), the model did attend to
the batch's padding and the finding is true: it is listed as such, not counted as a false alarm.

Then the modes this does not run (packed and right-padded training batches, output_attentions, beam search,
encoder-decoder and vision-language families: benchmarks/false_alarms_modes.py, each finding checked by what the
outputs depend on), over the same FAMILY names where given; --no-modes leaves them out.

    python benchmarks/false_alarms.py [--no-modes] [FAMILY ...]
"""

from __future__ import annotations

import sys
import time


# the findings that follow from a padding mask the model never got: pads seen, and a real token's row built from the
# ids alone (XLM's lengths assume right padding) seeing no key at all
PADDING = ("padding-ignored", "real-query-blind", "fully-masked")


def main(names: list[str]) -> int:
    from maskcli.checks.registry import severity
    from maskcli.errors import MaskError
    from maskcli.hf.families import default_config, names as families, tiny
    from maskcli.hf.report import view
    from maskcli.hf import run as hf_run
    from maskcli.hf.run import prompt, run

    handed = []  # for each forward generate made: was the batch's attention_mask in its inputs?
    build = hf_run.build

    def watched(config, attn, name):
        model = build(config, attn, name)
        prepare = model.prepare_inputs_for_generation

        def inputs(*args, **kwargs):
            out = prepare(*args, **kwargs)
            handed.append(out.get("attention_mask") is not None)
            return out
        model.prepare_inputs_for_generation = inputs
        return model
    hf_run.build = watched

    chosen = names or list(families())
    ran = alarms = true = 0
    started = time.perf_counter()
    for name in chosen:
        for attn, cache in ((attn, cache) for attn in ("sdpa", "eager") for cache in ("dynamic", "static")):
            try:
                config = tiny(default_config(name), name=name)
                batch = prompt((5, 3), None, config.pad_token_id if 0 <= (config.pad_token_id or 0) < 128 else 0, "left", 128)
                handed.clear()
                result = run(name, config, batch, new_tokens=2, attn=attn, cache=cache)
            except MaskError as error:
                print(f"{name} {attn} {cache}: not run ({str(error)[:80]})", flush=True)
                continue
            ran += 1
            wrong = [f for group in view(result).groups for f in group.findings if severity(f) == "wrong"]
            dropped = handed and not any(handed)
            if wrong and dropped and all(f.code in PADDING for f in wrong):
                true += 1
                print(f"{name} {attn} {cache}: true: {', '.join(sorted({f.code for f in wrong}))}: generate handed no forward the attention_mask "
                      "(the model attended to the padding)", flush=True)
            elif wrong:
                alarms += 1
                print(f"{name} {attn} {cache}: {len(wrong)} wrong: {wrong[0].code}: {wrong[0].message[:160]}", flush=True)
    print(f"{ran} runs of {len(chosen)} families, {alarms} with a wrong finding, {true} true findings (padding the "
          f"model was not handed), {time.perf_counter() - started:.0f} s")
    return 1 if alarms else 0


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    given = [arg for arg in sys.argv[1:] if arg != "--no-modes"]
    status = main(given)
    if "--no-modes" not in sys.argv[1:]:
        import false_alarms_modes  # (a sibling: this folder is sys.path[0])

        status = max(status, false_alarms_modes.main(given))
    sys.exit(status)
