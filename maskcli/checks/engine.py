"""Running the rules that read a run, and putting each finding beside the group of calls it is about."""

from __future__ import annotations

from maskcli.checks.context import Run, masked_somewhere, queries
from maskcli.checks import config
from maskcli.checks.registry import all_rules, severity
from maskcli.checks.spans import explained

CONFIG = {rule.code for rule in config.RULES}


def findings(run: Run) -> list:
    """(call, Finding) of every rule written in this package that reads calls, sites or steps."""
    attending = {call.where for call in run.calls if masked_somewhere(call)}  # a site that masks once is attention
    run = Run([call for call in run.calls if call.where in attending], run.tops)
    found, done = [], set()
    for rule in all_rules():
        if rule.given == "run" and rule.check not in done:
            done.add(rule.check)  # (one function may make the findings of several codes)
            found += rule.check(run)
    return found


def apply(groups: list, run: Run) -> list:
    """`groups` (trace's, each with .calls and .findings) with the findings of the rules added to the group of their
    call, each said once per group."""
    where = {call.index: group for group in groups for call in group.calls}
    for call, finding in findings(run):
        group = where.get(call.index)
        if group is not None and all((f.code, f.message) != (finding.code, finding.message) for f in group.findings):
            group.findings.append(finding)
    for group in groups:  # one bug reported once: a config rule's finding says what layer-differs (layers.py) would say
        codes = {f.code for f in group.findings}
        if codes & CONFIG:
            group.findings = [f for f in group.findings if f.code != "layer-differs"]
        if "fill-became-inf" in codes and any(f.code == "fill-became-inf" and f.severity is None for f in group.findings):
            group.findings = [f for f in group.findings if f.code != "fully-masked"]  # (the NaN rows, said with their cause)
    for group in groups:  # calls that see keys their model call's attention_mask marks as padding (arguments.py) say
        if any(f.code == "padding-ignored" for f in group.findings):  # it with its source: the same keys lost since
            group.findings = [f for f in group.findings if f.code != "padding-lost"]  # step 0 (steps.py) say it twice
        if any(f.code in ("varlen-leak", "varlen-disagree") for f in group.findings):  # documents given outright
            group.findings = [f for f in group.findings if f.code != "documents-leak"]  # (varlen.py): not said again
        if any(severity(f) == "wrong" for f in group.findings if f.code != "prefill-chunks-differ"):  # a chunk another
            group.findings = [f for f in group.findings if f.code != "prefill-chunks-differ"]  # rule calls wrong: said once
    for group in groups:  # is_causal aligned top-left (kernels.py), and the top-left mask it made (steps.py): one bug
        if any(f.code == "top-left-causal" for f in group.findings):  # said once, by the finding that names is_causal
            group.findings = [f for f in group.findings if f.code != "top-left-mask"]
            if group.calls and all(queries(call, run.top(call))[0] == 0 for call in group.calls):
                group.findings = [f for f in group.findings if f.code != "top-left-causal"]  # (queries at a static
                # cache's start, its slots past them unwritten: top-left is where they sit; cache.py reads those slots)
    judged = explained(run)  # later keys the model call's token types account for (spans.py): not a causal mask's slip
    for group in groups:
        if group.calls and all(call.index in judged for call in group.calls):
            group.findings = [f for f in group.findings if f.code != "sees-later"]
    return groups
