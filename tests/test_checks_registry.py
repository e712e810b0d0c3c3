"""checks/registry.py: every rule declared once with a severity and what it reads; every finding maskcli makes has a
rule; a finding's own severity wins over its rule's; renderers colour by severity."""

from __future__ import annotations

import re
from pathlib import Path

from maskcli.checks.registry import GIVEN, READS, SEVERITIES, all_rules, as_json, rule, severity, wrong
from maskcli.text import Finding

PACKAGE = Path(__file__).resolve().parent.parent / "maskcli"


def test_every_rule_has_a_known_severity_and_reading_and_a_check_written_in_the_checks_package():
    rules = all_rules()
    assert len({r.code for r in rules}) == len(rules)
    for r in rules:
        assert r.severity in SEVERITIES and r.reads in READS and r.given in GIVEN, r
        for given, check in r.checks():
            assert given in GIVEN and callable(check) and check.__module__.startswith("maskcli.checks."), r.code
        assert r.catches and not r.catches.endswith("."), r.code


def test_every_code_a_finding_is_made_with_is_a_rule():
    """Read off the source: each Finding("code", ...) written anywhere in maskcli has its rule."""
    made = set()
    for path in PACKAGE.rglob("*.py"):
        made |= set(re.findall(r'Finding\(\s*"([a-z0-9-]+)"', path.read_text()))
    assert len(made) > 20
    assert sorted(code for code in made if rule(code) is None) == []


def test_a_finding_says_its_own_severity_else_its_rules():
    assert severity(Finding("fully-masked", "x")) == "note"
    assert severity(Finding("fully-masked", "x", "wrong")) == "wrong"
    assert severity(Finding("top-left-causal", "x")) == "wrong"
    assert severity(Finding("no-such-code", "x")) == "suspicious"
    found = [Finding("fully-masked", "a"), Finding("padding-ignored", "b", cell=(0, 3, 1), source="attention_mask")]
    assert [f.code for f in wrong(found)] == ["padding-ignored"]
    assert as_json(found[1]) == {"code": "padding-ignored", "severity": "wrong", "message": "b", "source": "attention_mask",
                                 "cell": [0, 3, 1]}


def test_json_says_the_request_rank_and_step_a_finding_is_about_where_it_names_them():
    assert as_json(Finding("no-keys", "a", request=2)) == {"code": "no-keys", "severity": "wrong", "message": "a", "request": 2}
    assert as_json(Finding("shard-uneven", "b", rank=0, cell=(1, 1))) == {
        "code": "shard-uneven", "severity": "suspicious", "message": "b", "cell": [1, 1], "rank": 0}
    assert as_json(Finding("rank-window", "c", rank=3, step=0)) == {
        "code": "rank-window", "severity": "suspicious", "message": "c", "rank": 3, "step": 0}
    assert "request" not in as_json(Finding("no-keys", "d")) and "rank" not in as_json(Finding("shard-uneven", "e"))


def test_the_trace_report_colours_a_finding_by_its_severity():
    from types import SimpleNamespace

    from maskcli.render.trace import views

    call = SimpleNamespace(shape=(1, 1, 2, 2), api="sdpa")
    group = SimpleNamespace(first=call, calls=[call], where="attn", steps="prefill", name="causal", expression="causal",
                            named=True, findings=[Finding("fully-masked", "a"), Finding("fully-masked", "b", "wrong"),
                                      Finding("sees-later", "c")])
    assert [view.style for view in views([group], 1, "p", 0)[2:]] == ["dim", "red", "yellow"]


def test_the_docs_page_has_a_section_for_every_rule_that_reads_a_trace_run():
    page = (PACKAGE.parent / "docs" / "checks.md").read_text()
    assert [r.code for r in all_rules() if r.given == "run" and f"**{r.code}**" not in page] == []


def test_inspect_and_attend_findings_are_coloured_by_their_severity():
    """render/tables.py's findings_text: red for wrong, yellow for suspicious, dim for a note (ANSI SGR 31, 33, 2)."""
    from io import StringIO

    from rich.console import Console

    from maskcli.render.tables import findings_text

    out = StringIO()
    console = Console(file=out, force_terminal=True, color_system="standard", width=120)
    console.print(findings_text([Finding("sentinel-overflow", "first"), Finding("sees-later", "second"),
                                 Finding("fully-masked", "third"), Finding("fully-masked", "fourth", "wrong")]))
    lines = {word: line for line in out.getvalue().splitlines() for word in ("first", "second", "third", "fourth") if word in line}
    assert [re.search(r"\x1b\[([0-9;]+)m" + word, lines[word]).group(1) for word in ("first", "second", "third", "fourth")] == \
        ["31", "33", "2", "31"]


def test_run_calls_each_check_given_what_the_caller_holds_once_in_the_registrys_order():
    """shard's layout rules through the registry: a layout with tokens 2 and 4 on no rank, token 1 twice on rank 0, and
    3 slots against 1 (coverage makes two codes, called once); a padded one; a whole one."""
    from maskcli.checks.registry import run
    from maskcli.shard import layouts

    found = run("layout", layouts.from_indices([[0, 1, 1], [3]], 5, "file"))
    assert [(f.code, f.rank) for f in found] == [("shard-dropped-token", None), ("shard-duplicate-token", 0), ("shard-uneven", 0)]
    assert [f.code for f in run("layout", layouts.headtail(30, 4))] == ["shard-padding"]
    assert run("layout", layouts.headtail(32, 4)) == []


def test_outside_checks_a_rules_check_is_asked_of_the_registry_not_imported():
    """Read off the source: no module outside checks/ imports the function a rule declares as one of its checks (a new
    rule then touches only its module and MODULES): not trace's report, serve or shard, nor pack (its batch rules),
    inspect (a tensor's rows and top-left causal) or attention (the mask attend runs)."""
    declared = {(check.__module__, check.__name__) for r in all_rules() for _, check in r.checks()}
    assert {("maskcli.checks.rows", "tensor_rows"), ("maskcli.checks.stages", "mask_findings"),
            ("maskcli.checks.packing", "on_labels")} <= declared
    imported = set()
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "checks":
            continue
        text = path.read_text()
        for module, wrapped, line in re.findall(r"from (maskcli\.checks\.\w+) import (?:\(([^)]*)\)|([\w, ]+)$)", text, re.M):
            for name in re.findall(r"(\w+)(?: as \w+)?", wrapped or line):
                imported.add((path.relative_to(PACKAGE).as_posix(), module, name))
        for module, alias in re.findall(r"from maskcli\.checks import (\w+) as (\w+)", text):
            imported |= {(path.relative_to(PACKAGE).as_posix(), f"maskcli.checks.{module}", name)
                         for name in re.findall(rf"\b{alias}\.(\w+)\(", text)}
    called = sorted((where, name) for where, module, name in imported if (module, name) in declared)
    assert called == []
    # nor does pack, inspect or attention call a rule module's functions beside the registry (the helpers a check
    # wraps, rows.py's given_*, packing.py's labels): they hand the registry what the rules read
    import importlib
    import inspect

    from maskcli.checks.registry import MODULES

    beside = sorted((where, name) for where, module, name in imported
                    if where.split("/")[0] in ("pack", "inspect", "attention") and module.rsplit(".", 1)[1] in MODULES
                    and inspect.isfunction(getattr(importlib.import_module(module), name, None)))
    assert beside == []
