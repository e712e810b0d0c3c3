"""checks/memlen.py (and trace/stated.py's `mem_len`): a recurrent-memory model's queries against the memory length
it states."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkbugs import check_bug, first, traced

MEMLEN = Path(__file__).parent / "data" / "memlen"
BUGS = Path(__file__).parent / "data" / "bugs"


def test_feedback_transformer_memory_truncated_on_batch_axis(tmp_path):
    """feedback-transformer-pytorch 683bba1: `memory_keys[-mem_len:]` slices the batch, the memory grows past mem_len.

    Its fix keeps upstream's RelativePositionBias, which puts the queries at arange(i) while the causal mask puts them
    after the memory (triu_(j - i + 1)): at a segment after the first, a query's bias toward a memory key is that of a
    key after it. position-bias-misplaced says so on both versions, and it is the only wrong finding on the fix."""
    name = "feedback_transformer_memory_truncated_on_batch_axis"
    status, found, report = traced(tmp_path, name, False, BUGS)
    assert status == 1 and any(f["code"] == "memory-over-length" and f["severity"] == "wrong" for f in found), report
    status, found, report = traced(tmp_path, name, True, BUGS)
    (bias,) = [f for f in found if f["severity"] == "wrong"]
    assert bias["code"] == "position-bias-misplaced" and status == 1, report
    # the first cell, segment 2 (2 memory positions, 2 queries: 4 keys): query 2 toward key 1, one key before it as the
    # mask places the query, one key after it as the bias does (its row 0)
    q_len, k_len = 2, 4
    query, key = tuple(bias["cell"])[1:]
    assert (query, key) == (2, 1)
    assert key - query == -1 and key - (query - (k_len - q_len)) == 1


def test_xl_memory_size_checked_on_batch_axis(tmp_path):
    """Written another way: mem_len on the layer itself, SDPA with a bool mask, the size test on the batch axis; the
    first cell is a double loop's over segments of 3 behind a memory of every earlier one (a query that sees a key
    older than the 4 memory positions). Its fix keeps the whole buffer and hides the older keys: quiet."""
    status, found, report = traced(tmp_path, "xl_memory_size_checked_on_batch_axis", False, MEMLEN)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "memory-over-length"]
    assert hits and all(f["severity"] == "wrong" for f in hits), report
    mem_len, segment = 4, 3
    memory = next(m for m in range(0, 12, segment) if m > mem_len)  # the first call whose memory outgrows it
    assert tuple(hits[0]["cell"]) == first(
        (2, segment, memory + segment), lambda b, q, k: k <= memory + q and k < memory - mem_len)
    status, found, report = traced(tmp_path, "xl_memory_size_checked_on_batch_axis", True, MEMLEN)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def _first_dropped(held: list[int], segment: int, mem_len: int) -> tuple[int, int, int]:
    """(step, memory keys, keys dropped) of the first step whose memory is short of min(mem_len, last memory + segment),
    a loop over the steps' memories (the reference: Transformer-XL keeps cat([mem, h])[-mem_len:])."""
    for step in range(1, len(held)):
        want = min(mem_len, held[step - 1] + segment)
        if 0 < held[step] < want:
            return step, held[step], want - held[step]
    raise AssertionError("no step drops memory")


def test_transformers_rl_gtrxl_memory_pinned_at_its_first_20_zero_slots(tmp_path):
    """dhruvramani/Transformers-RL#7, fixed by PR #8 (written blind, batch blind-fn): GTrXL's memory started as 20
    hard-coded zero states and `beg_idx = end_idx - mem_len` cut it to its own current length, so it stayed at 20 where
    the model keeps `self.mem_len = 100`. The fix (an empty memory, the last self.mem_len kept) grows 0, 20 .. 100:
    quiet."""
    found = check_bug(tmp_path, "transformers_rl_gtrxl_memory_zero_init_fixed_window", "memory-not-kept")
    step, held, dropped = _first_dropped([20] * 6, 20, 100)  # six segments of 20, the memory 20 at each
    assert found[0]["message"].startswith(f"at step {step} the segment's queries see {held} memory keys")
    assert f"{dropped} keys the model states it keeps were dropped" in found[0]["message"]


def test_a_memory_cut_to_the_segments_length_is_found(tmp_path):
    """Written another way: a Transformer-XL language model, batch first, SDPA with a boolean mask, whose update keeps
    the last `qlen` hidden states (one segment of 16) where the module says `self.mem_len = 48`. Fix quiet."""
    found = check_bug(tmp_path, "txl_lm_memory_cut_to_segment_length_sdpa", "memory-not-kept", folder=MEMLEN)
    step, held, dropped = _first_dropped([0, 16, 16, 16, 16], 16, 48)
    assert found[0]["message"].startswith(f"at step {step} the segment's queries see {held} memory keys")
    assert f"{dropped} keys the model states it keeps were dropped" in found[0]["message"]


def test_a_memory_capped_at_mem_len_and_emptied_per_episode_is_quiet(tmp_path):
    """A correct recurrent-memory policy (eager softmax, time first): its memory grows to mem_len = 30 and stays there,
    is emptied at each new episode, and meets a shorter last segment: no finding."""
    status, found, report = traced(tmp_path, "episodic_memory_reset_and_capped_softmax", False, MEMLEN)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_model_re_lengthed_for_evaluation_is_held_to_the_memory_it_states_as_each_call_runs(tmp_path):
    """NVIDIA's Transformer-XL (written blind, quiet-r128a) trains with mem_len equal to the segment and evaluates after
    `reset_length(mem_len=...)`: the config read once the run is over holds the last length only, so each call is held
    to `self.mem_len` as it ran. Written another way: the buggy update keeps the training length it copied, so the
    evaluation's memory stays at one segment of 16 where the model now states 40; the fix grows it 0, 16, 32, 40."""
    found = check_bug(tmp_path, "txl_relengthed_for_eval_memory_kept_at_train_length", "memory-not-kept", folder=MEMLEN)
    train = [0, 16, 16, 16]  # (four training segments, mem_len 16: nothing dropped there)
    with pytest.raises(AssertionError):
        _first_dropped(train, 16, 16)
    step, held, dropped = _first_dropped([0, 16, 16, 16, 16], 16, 40)
    assert found[0]["message"].startswith(f"at step {len(train) + step} the segment's queries see {held} memory keys")
    assert f"{dropped} keys the model states it keeps were dropped" in found[0]["message"]
    assert "self.mem_len=40 of MemoryLM as this call ran" in found[0]["message"]
