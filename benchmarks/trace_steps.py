"""Where trace's cost goes on a tiny Hugging Face llama's generate: each step of a traced call timed in place.

    python benchmarks/trace_steps.py [--runs 40] [--bound]

The generate of benchmarks/trace.py (LlamaConfig, 2 layers, batch 2 with left padding, 3 new tokens: 6 attention
calls, 3 calls of the model). Each step listed in STEPS is wrapped by a timer of this thread's CPU clock
(time.thread_time_ns) for the run, and a traced generate alternates with an untraced one; it prints the median
untraced and traced generate, and each step's CPU time a generate, its calls a generate and a call's mean. After each
traced run its model calls' tops are read (Trace.tops: a Top handed only plain values and small integer tensors is
made then, trace/later.py, outside the generate's time: its steps, later.Later.make, in the table all the same).
The steps nest (a call's _capture holds its _record, which holds the readers), so their times do not add up, and
each timer costs about a microsecond of its own. With --bound, a third run alternates with the two: the readers a
call-site cache would skip at a site's repeat calls (Sites.note's readers of the frames, the modules and the
site's line, and the documents an inner module was handed) skipped at every call after the first of its site
(unsound: for the bound only; what such a cache could save at most).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import time
from collections import Counter, defaultdict

import torch

import maskcli

# (module, class or "", attribute): each step as the code that runs it looks it up
STEPS = [("maskcli.trace.capture", "Trace", "__init__"), ("maskcli.trace.capture", "Trace", "__enter__"),
         ("maskcli.trace.capture", "Trace", "__exit__"), ("maskcli.trace.sites", "Sites", "_name"),
         ("maskcli.trace.follow", "Follow", "dispatch"), ("maskcli.trace.capture", "Trace", "_capture"),
         ("maskcli.trace.capture", "", "walk"), ("maskcli.trace.capture", "", "running"),
         ("maskcli.trace.sites", "Sites", "load"), ("maskcli.trace.outer", "Outer", "_outer"),
         ("maskcli.trace.capture", "Trace", "_record"), ("maskcli.trace.masks", "", "key_reads"),
         ("maskcli.trace.masks", "", "query_tensor"), ("maskcli.trace.masks", "", "stored"),
         ("maskcli.trace.sites", "Sites", "note"), ("maskcli.trace.outer", "Outer", "_finish"),
         ("maskcli.trace.tops", "", "top"), ("maskcli.trace.tops", "", "withheld"),
         ("maskcli.trace.later", "", "later"), ("maskcli.trace.later", "Later", "make"),
         ("maskcli.trace.entry", "", "patch")]


def _benchmark_trace():
    """benchmarks/trace.py as a module (its name is the standard library's `trace`: loaded from its path)."""
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("maskcli_benchmark_trace", Path(__file__).with_name("trace.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--bound", action="store_true", help="also the bound of a call-site cache of the readers")
    args = parser.parse_args()
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    model, ids, mask = _benchmark_trace().tiny_llama(LlamaConfig, LlamaForCausalLM)
    clock = time.thread_time_ns
    spent, calls = defaultdict(int), Counter()
    skipping = _bound() if args.bound else None

    def timed(label, function):
        def step(*a, **k):
            start = clock()
            try:
                return function(*a, **k)
            finally:
                spent[label] += clock() - start
                calls[label] += 1
        return step

    if not args.bound:  # (the bound is timed without the timers: they would cost more than what it skips)
        for module_name, owner, name in STEPS:
            module = importlib.import_module(module_name)
            holder = getattr(module, owner) if owner else module
            label = f"{module_name.rsplit('.', 1)[-1]}.{owner + '.' if owner else ''}{name}"
            setattr(holder, name, timed(label, holder.__dict__[name] if owner else getattr(holder, name)))

    def run(context) -> int:
        start = clock()
        with context:
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        spent = clock() - start
        if hasattr(context, "tops"):
            context.tops  # noqa: B018 - (the tops made once the run is over: their steps timed, not the generate's)
        return spent

    def bounded() -> int:
        skipping["on"], skipping["sites"], skipping["repeat"] = True, set(), False
        try:
            return run(maskcli.trace())
        finally:
            skipping["on"], skipping["repeat"] = False, False

    for _ in range(3):  # warm-up
        run(contextlib.nullcontext()), run(maskcli.trace())
    spent.clear(), calls.clear()
    samples = []
    for i in range(args.runs):  # (the bound's run before the trace's at every other run: neither gains the other's caches)
        plain_time = run(contextlib.nullcontext())
        if skipping and i % 2:
            bound_time = bounded()
            samples.append((plain_time, run(maskcli.trace()), bound_time))
        else:
            samples.append((plain_time, run(maskcli.trace()), bounded() if skipping else 0))
    plain, traced = (statistics.median(s[i] for s in samples) / 1e6 for i in (0, 1))
    print(f"tiny HF llama generate (6 attention calls, 3 model calls), {args.runs} runs, thread CPU: untraced {plain:.2f} ms, "
          f"traced {traced:.2f} ms ({traced / plain:.2f}x): trace's cost {(traced - plain) * 1e3:.0f} us a generate, "
          f"{(traced - plain) * 1e3 / 6:.0f} us a call")
    if skipping:
        bound = statistics.median(s[2] for s in samples) / 1e6
        q1, saved, q3 = statistics.quantiles([(s[1] - s[2]) / 1e3 for s in samples], n=4)
        print(f"with the readers a call-site cache would skip skipped at each site's repeat calls: {bound:.2f} ms "
              f"({bound / plain:.2f}x); run for run {saved:.0f} us a generate less (quartiles {q1:.0f} to {q3:.0f})")
        return
    print(f"{'step':<28} {'us a generate':>14} {'calls':>6} {'us a call':>10}")
    for label in sorted(spent, key=lambda k: -spent[k]):
        print(f"{label:<28} {spent[label] / args.runs / 1e3:>14.0f} {calls[label] / args.runs:>6.1f} "
              f"{spent[label] / calls[label] / 1e3:>10.1f}")


def _bound() -> dict:
    """Sites.note and the documents handed to inner modules skipped at a call whose innermost module attended already
    in this trace (a repeat call of its site), while state["on"] (the bound of a call-site cache of those readers: unsound, measured only)."""
    import maskcli.trace.capture as capture
    import maskcli.trace.sites as sites

    state = {"on": False, "sites": set(), "repeat": False}
    note, handed = sites.Sites.note, capture.handed

    def bounded_note(self, details, caller, shape):
        site = id(self.stack[-1]) if self.stack else None
        state["repeat"] = state["on"] and site in state["sites"]
        if state["repeat"]:
            return None
        state["sites"].add(site)
        return note(self, details, caller, shape)

    sites.Sites.note = bounded_note
    capture.handed = lambda variables: None if state["repeat"] else handed(variables)
    return state


if __name__ == "__main__":
    main()
