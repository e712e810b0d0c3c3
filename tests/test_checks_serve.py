"""checks/serve.py (and servemasks.py, servesteps.py, serveexpect.py): every finding serve makes is a rule of the
registry, its severity the rule's where it states none, coloured and counted by severity; and the rules no other serve
test reaches, each on a bug and on the correct batch."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import pytest

from maskcli.checks.registry import READS, SEVERITIES, all_rules, rule, severity, wrong
from maskcli.checks.serve import check
from maskcli.text import Finding
from maskcli.serve.engines import from_tensors
from serve_builders import BUILDERS, Req, allocate, flashinfer, vllm, vllm_local

CHECKS = Path(__file__).resolve().parent.parent / "maskcli" / "checks"


def codes(tensors):
    return [f.code for f in check(from_tensors(tensors, "batch"))]


def test_every_code_serve_makes_is_a_rule_of_the_module_that_makes_it():
    """Read off the source of checks/serve*.py: Finding("code", ...) and first_difference(..., code="..."); serve/
    makes none of its own."""
    made = set()
    for path in CHECKS.glob("serve*.py"):
        made |= set(re.findall(r'Finding\(\s*"([a-z0-9-]+)"', path.read_text()))
        made |= set(re.findall(r'code="([a-z0-9-]+)"', path.read_text()))
    assert len(made) >= 25
    assert sorted(code for code in made if rule(code) is None) == []
    for path in (CHECKS.parent / "serve").glob("*.py"):
        assert "Finding(" not in path.read_text(), path.name
    serve_rules = [r for r in all_rules() if r.check.__module__.startswith("maskcli.checks.serve")]
    assert {r.code for r in serve_rules} == made
    for r in serve_rules:  # each names a function of the module that declares it
        module = importlib.import_module(r.check.__module__)
        assert r.severity in SEVERITIES and r.reads in READS and getattr(module, r.check.__name__) is r.check, r.code
        assert r in module.RULES, r.code


def test_check_runs_every_rule_given_a_batchs_metadata_through_the_registry():
    """Each batch rule's function runs once (one function makes several codes); --expect's, --model's and the
    steps' rules need more than the batch, and serve asks the registry for them with it."""
    from maskcli.checks import serve, servemasks

    given = {r.check for r in all_rules() if r.given == "metadata"}
    assert given == {serve.lengths, serve.pages, servemasks.cascade, servemasks.local, servemasks.trees}
    reqs = allocate([Req(0, 3), Req(5, 4)], 4)
    good = vllm(reqs, 4)
    assert check(from_tensors(good, "batch")) == []
    bad = dict(good, block_table_tensor=good["block_table_tensor"][..., :2])
    assert [(f.code, f.request) for f in check(from_tensors(bad, "batch"))] == [("table-short", 1)]


def test_a_serve_finding_is_a_text_finding_whose_severity_is_its_rules_unless_it_says_one():
    from maskcli.render.serve import finding_json

    found = Finding("no-keys", "m", request=1)
    assert found.severity is None and severity(found) == "wrong"
    note = Finding("expect", "every request matched holds", "note")
    assert severity(note) == "note" and wrong([found, note]) == [found]
    assert finding_json(found) == {"code": "no-keys", "severity": "wrong", "request": 1, "cell": None, "message": "m"}
    assert finding_json(Finding("seq-len", "m", request=0, cell=(8, 1)))["cell"] == [8, 1]


def test_serve_colours_a_finding_by_its_severity():
    from maskcli.render.serve import findings_text

    shown = findings_text([Finding("seq-len", "a", request=0), Finding("model", "b", "suspicious"), Finding("expect", "c", "note")])
    assert [(line.plain.split(":")[0], line.style) for line in shown] == [
        ("• wrong seq-len (request 0)", "red"), ("• suspicious model", "yellow"), ("• note expect", "dim")]


@pytest.mark.parametrize("engine, table", [("vllm", "block_table_tensor"), ("flash_attn", "block_table"),
                                           ("trtllm", "kv_cache_block_offsets")])
def test_table_short(engine, table):
    """Request 1 (9 keys, 3 blocks of 4) given a table of 2 blocks: a block table sized for another batch."""
    reqs = allocate([Req(0, 3), Req(5, 4)], 4)
    good = BUILDERS[engine](reqs, 4)
    assert codes(good) == []
    found = check(from_tensors(dict(good, **{table: good[table][..., :2]}), "batch"))
    assert [(f.code, f.request) for f in found] == [("table-short", 1)]


def test_page_twice():
    reqs = allocate([Req(0, 3), Req(5, 4)], 4)
    reqs[1].pages[2] = reqs[1].pages[0]  # block 2 on block 0's page: positions 8.. overwrite keys 0..
    for build in (vllm, flashinfer):
        assert [(f.code, f.request) for f in check(from_tensors(build(reqs, 4), "batch"))] == [("page-twice", 1)]


def test_cascade_lengths():
    """vLLM's FlashAttention cascade (vllm/v1/attention/backends/flash_attn.py build): cu_prefix_query_lens = [0,
    num_actual_tokens], suffix_kv_lens = seq_lens - common_prefix_len."""
    reqs = allocate([Req(9, 2), Req(10, 3)], 4, shared=2)
    seq = np.array([r.seq for r in reqs])
    good = vllm(reqs, 4, common_prefix_len=8, cu_prefix_query_lens=[0, 5], prefix_kv_lens=[8], suffix_kv_lens=seq - 8)
    assert codes(good) == []
    assert codes(dict(good, suffix_kv_lens=seq)) == ["cascade-lengths"]  # the suffix pass would read the prefix again
    assert codes(dict(good, cu_prefix_query_lens=[0, 13])) == ["cascade-lengths"]  # full lengths, not the new tokens


def test_local_lengths_and_a_virtual_batch_across_a_chunk():
    reqs = allocate([Req(2, 4), Req(5, 10), Req(6, 3)], 2)
    good = vllm_local(reqs, 2, 4)  # virtual batches of queries [2, 2, 3, 4, 3, 2, 1] over chunks of 4
    assert codes(good) == []
    starts = good["local_query_start_loc"].copy()
    starts[-1] += 1
    assert codes(dict(good, local_query_start_loc=starts)) == ["local-lengths"]
    merged = dict(good, local_query_start_loc=np.delete(good["local_query_start_loc"], 3),  # batches 2 and 3 as one
                  local_seqused_k=np.delete(good["local_seqused_k"], 2), local_block_table=np.delete(good["local_block_table"], 2, 0))
    found = check(from_tensors(merged, "batch"))
    assert [(f.code, f.request) for f in found] == [("local-crosses-chunk", 1)]
    assert "request 1's queries 5..11, across a chunk of 4" in found[0].message


def test_expect_given_the_batchs_name_compares_every_request_and_names_the_batch():
    """trace --api vllm's --expect: its pattern chose the step by its layers, so every request of the step is compared
    (through the registry), the first differing cell found here by a double loop over each request's positions."""
    from maskcli.checks import registry

    b = from_tensors(vllm(allocate([Req(0, 3), Req(5, 4)], 4), 4), "batch")
    first = None
    for r in range(b.requests):
        q_start, q_len, seq_len = b.frame(r)
        for q in range(q_start, q_start + q_len):
            for k in range(seq_len):
                if first is None and (k <= q) != (q - 2 < k <= q):  # each request's causal mask against window(2)
                    first = (r, q, k)
    found = registry.run("expectations", b, [("layers.0", "window(2)")], where="vllm step 3 (layers.0)")
    assert [(f.code, f.request, f.cell) for f in found] == [("expect", first[0], first[1:])]
    assert found[0].message.startswith(f"--expect layers.0=window(2): vllm step 3 (layers.0): request {first[0]} ")
    assert found[0].message.endswith("; 1 more differ: requests 1")
    [alone] = registry.run("expectations", b, [("layers.0", "window(2)")])  # serve's own: the pattern names requests
    assert "no request matches 'layers.0'" in alone.message
    assert registry.run("expectations", b, [("x", "causal")], where="vllm step 3 (layers.0)") == [
        Finding("expect", "--expect: every request matched holds (1 expectation)", "note")]
