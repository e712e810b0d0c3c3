"""Every rule that finds a wrong mask, collected from the modules of this package as kinds and formats are.

A rule declares its code (the stable word a finding carries), its severity, what it reads and
what it catches. Severity is what a renderer colours by and what sets the exit status:

- wrong: the mask differs from what the program itself states (its config, its arguments, an
  earlier step of the same call site, the cache's written slots, the kernel's own rules);
- suspicious: a shape that is often a bug but may be meant (no expectation says which);
- note: routine structure worth a word (padding query rows that see no key and get 0 from the kernel).

What a rule reads: one `call` (or one tensor a user gave), a call `site` across its steps, the
`steps` of a whole run (calls with the model call that made them: its config and arguments), a
packed `batch` (pack), or the `ranks` of a context-parallel split (shard). What its check is `given`: a trace's `run`
(engine.py runs these over a trace), or what the command that calls it has in hand: a trace group (grouped.py's
Grouped: the calls of one mask, its stored cells and name), which trace's report hands to the rules given its
`cells`, then what it was `named`, then the call's `scores`, then what the `kernel` made of its arguments (findings
in that order); a `tensor` a user gave (inspect), attention `stages` (attend) or the `mask` alone it runs (attend,
verify), a packed `batch` (pack: pack/findings.py's Packed), a shard
`layout`, one mask's `split` over it, one rank's captured `part`, a serving engine's batch `metadata` (alone; with
serve's --expect `expectations`; with --model's `layer-masks`) or a request's steps across step files
(`request-steps`), or every rank's calls of a traced job (`ranks`).
A code that several commands find (fully-masked, sees-later, top-left-causal) is one rule: its check is the trace
report's, and its `also` holds the check given what another command holds (a tensor inspect was given: rows.py's
tensor_rows, kernels.py's tensor_top_left; the mask attend runs: stages.py's mask_findings). No code outside this
package calls a check: every command asks run().
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from maskcli.text import Finding

SEVERITIES = ("wrong", "suspicious", "note")
READS = ("call", "site", "steps", "batch", "ranks")
GIVEN = ("run", "cells", "named", "scores", "kernel", "tensor", "stages", "mask", "batch", "layout", "split", "part", "metadata",
         "expectations", "layer-masks", "request-steps", "ranks")
MODULES = ("kernels", "config", "anchored", "symmetric", "handed", "causal_lm", "rolled", "paged", "arguments",
           "memory", "heads", "sides", "steps", "cache", "spans", "own", "dropped", "tokens", "bosmasked", "flatgrid", "layers", "dtypes",
           "softmaxed", "padflag", "varlen", "prefill", "boundaries", "tree", "rows", "fills", "named", "shapes",
           "stages", "packing", "held", "padids", "heldcells", "frames", "subsampled", "patches", "nans", "segments", "withheld", "swin", "across",
           "crosspad", "crossq", "batchaxis", "decoders", "headrows", "evicted", "media", "shard", "serve", "servemasks",
           "servesteps", "serveexpect", "ranks", "fullblocks", "zerokv", "memlen", "graphs", "reach", "neighbours", "reqlens", "turned", "gathered", "chunkrows", "discarded",
           "items", "imageruns", "expanded", "queryaxis", "padded", "directions", "rowless", "crosskeys", "numbered", "scored",
           "memturned", "memorypads", "globaltokens", "sidewindows", "chunkahead", "nomask", "foldedcross", "jointtext", "fewseen",
           "stepwindows", "windowreach", "handedcausal", "docrows", "cachewindow", "slicedkeys", "alone", "swinroll", "weakfill",
           "namedcausal", "cachedrop", "maskrows", "branchrows", "shiftedrows", "framebudget", "zeromemory", "frameblocks",
           "callcausal", "chunkleft", "runalone", "swappedprefix", "twopaths", "weighted", "flexrows", "askedcausal", "padqueries", "padfill",
           "latefix", "singleton", "fillleak", "layerwindow", "jointpad", "convpad", "convleft", "mediarows", "rowsonqueries", "padtail", "queriesonbatch",
           "blockpad", "prefixloss", "targetmap", "relbias", "biaswindows", "gatheredlater", "relindex", "swinedit", "groups",
           "hiddenreal", "blocksteps", "heldtree", "contextlater",
           "stalled", "repeated", "causalnone", "onesided", "topk", "aloneplaces", "evictbudget", "pooledaxis", "continued", "absentinput", "placedpads",
           "regrouped", "pooledpad", "pooledat", "pooledend", "maskmean", "emptytrained", "offgrid", "keyscale", "blockwindow", "uncached", "permuted",
           "sinkslots", "multiplied", "densesets", "owncut", "sinkblend", "poolspan", "skipped", "routed", "headadded",
           "builtcausal", "querygroups", "padend", "leftoff", "positioned", "dropshare", "rowsout", "steppad", "memflip",
           "madeframes", "beamcache", "rewritten", "restarted", "locallayers", "overqueries", "padgroup", "condwithheld",
           "refed", "mediapad", "cachedpositions", "heldsinks", "prefixpool", "nowindow", "slicedmask", "alibisign", "loopcausal", "ownhidden",
           "shortmask", "evaldrop", "flipped", "positionrow", "broadpositions",
           "rotatedkeys", "biasdropped")


@dataclass(frozen=True)
class Rule:
    code: str
    severity: str  # one of SEVERITIES: a finding may say a worse or milder one of itself (Finding.severity)
    reads: str  # one of READS
    catches: str  # the bug, in one line (docs, `maskcli checks`)
    check: Callable  # the function of this package that makes its findings (one function may make several codes)
    given: str = "run"  # one of GIVEN: what `check` is called with
    # the same code found in what other commands hold: (given, check) pairs (the trace group's fully-masked rows, found
    # in a tensor inspect was given and in the mask attend runs, is one rule)
    also: tuple[tuple[str, Callable], ...] = ()

    def checks(self) -> tuple[tuple[str, Callable], ...]:
        """Each (given, check) of the rule: its own, then those it `also` has."""
        return ((self.given, self.check),) + self.also


@functools.cache
def all_rules() -> tuple[Rule, ...]:
    """Every rule, by module in MODULES' order; a code defined twice is a bug in maskcli."""
    rules = [rule for name in MODULES for rule in importlib.import_module(f"maskcli.checks.{name}").RULES]
    codes = [rule.code for rule in rules]
    twice = sorted({code for code in codes if codes.count(code) > 1})
    if twice:
        raise RuntimeError(f"rules defined twice: {', '.join(twice)}")
    return tuple(rules)


@functools.cache
def _by_code() -> dict[str, Rule]:
    return {rule.code: rule for rule in all_rules()}


def rule(code: str) -> Rule | None:
    return _by_code().get(code)


@functools.cache
def given(asked: str) -> tuple[Callable, ...]:
    """Each check function of a rule that is `asked` what the caller holds (one of GIVEN), once (one function may make
    several codes), in the registry's order: read once a process (a trace's every group asks it)."""
    found = {}
    for each in all_rules():
        for kind, check in each.checks():
            if kind == asked:
                found.setdefault(check, None)
    return tuple(found)


def run(asked: str, *args, **kwargs) -> list:
    """The findings of every rule whose check is given what the caller holds (`asked`, one of GIVEN), each function
    called once, in the registry's order. (A rule given every rank's calls, `ranks`, says which call each finding is
    about: (call, Finding) pairs.)"""
    found = []
    for check in given(asked):
        found += check(*args, **kwargs)
    return found


def severity(finding: Finding) -> str:
    """The finding's own severity, else its rule's; a code no rule declares is suspicious."""
    if finding.severity is not None:
        return finding.severity
    found = rule(finding.code)
    return found.severity if found is not None else "suspicious"


def wrong(findings) -> list[Finding]:
    return [f for f in findings if severity(f) == "wrong"]


def as_json(finding: Finding) -> dict:
    """code, severity, message, and what was expected, from where, the first differing cell, and the request, rank
    and step it is about, each where known."""
    found = {"code": finding.code, "severity": severity(finding), "message": finding.message}
    for name in ("expected", "source", "cell", "request", "rank", "step"):
        value = getattr(finding, name)
        if value is not None:
            found[name] = list(value) if isinstance(value, tuple) else value
    return found
