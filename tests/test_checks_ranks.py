"""checks/ranks.py: the replicas of one layer across ranks, told apart by window and padding side only."""

from __future__ import annotations

from types import SimpleNamespace

from maskcli.checks.ranks import replicas
from maskcli.checks.registry import severity


def call(rank: int, name: str, where: str = "layers.0.attn", step: int = 0):
    return SimpleNamespace(rank=rank, where=where, step=step, api="sdpa", name=name)


def test_the_rank_whose_window_differs_from_most_is_named_wrong_under_ddp():
    calls = [call(0, "causal & window(4)"), call(1, "causal & window(8)"), call(2, "causal & window(4)"),
             call(1, "causal & window(8)", "layers.1.attn"), call(0, "causal & window(4)", "layers.1.attn")]
    found = replicas(calls, replicated=True)
    assert [(c.rank, f.code, severity(f)) for c, f in found] == [(1, "rank-window", "wrong")]
    assert (found[0][1].rank, found[0][1].step) == (1, 0)  # the rank it is about, and the first step it differs at
    assert found[0][1].message == ("rank 1's layers.0.attn, layers.1.attn (step 0): window(8), where ranks 0, 2 have window(4): "
                                   "the replicas of one layer differ")


def test_without_ddp_a_window_that_differs_is_suspicious_and_says_what_it_depends_on():
    ((_, finding),) = replicas([call(0, "window(3)"), call(1, "window(5)")])
    assert severity(finding) == "suspicious" and "if these ranks run one model" in finding.message


def test_padding_lengths_are_each_ranks_data_and_causal_against_full_is_context_parallel_blocks():
    calls = [call(0, "causal (--lengths 5,4)"), call(1, "causal (--lengths 6,3)"), call(0, "causal", step=1), call(1, "full", step=1)]
    assert replicas(calls, replicated=True) == []


def test_a_rank_padding_the_other_side_is_suspicious():
    ((c, finding),) = replicas([call(0, "causal (--lengths 5,4)"), call(1, "causal (--lengths 5,4 --pad left)")], replicated=True)
    assert c.rank == 1 and finding.code == "rank-padding-side" and severity(finding) == "suspicious"
    assert "left padding, where rank 0 has right padding" in finding.message


def test_two_ranks_that_disagree_name_the_higher_one():
    ((c, finding),) = replicas([call(0, "window(3)"), call(1, "window(5)")], replicated=True)
    assert c.rank == finding.rank == 1


def test_the_step_named_is_the_first_step_the_rank_differs_at():
    calls = [call(0, "window(3)", step=2), call(1, "window(5)", step=2), call(0, "window(3)", step=5), call(1, "window(5)", step=5)]
    ((_, finding),) = replicas(calls)
    assert (finding.rank, finding.step) == (1, 2) and "(steps 2, 5)" in finding.message
