"""checks/broadpositions.py: position_ids of one column handed with several tokens a row that attend together."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import check_bug
from maskcli.checks.broadpositions import broadcast_positions
from maskcli.checks.context import Run, Top

HERE = Path(__file__).parent / "data" / "broadpositions"


def test_optimum_intel_assisted_verify_step_handed_the_last_position_only(tmp_path):
    """huggingface/optimum-intel#566 (written blind, blind-wd; missed before): IPEXModelForCausalLM kept
    `position_ids[:, -1].unsqueeze(-1)` once a cache existed, so assisted decoding's verify step of 4 tokens (the last
    accepted and 3 drafts) put all of them at the last one's position. The fix (`[:, -input_ids.shape[-1]:]`) quiet."""
    found = check_bug(tmp_path, "optimum_intel_ipex_causal_lm_assisted_verify_position_ids_last_only", "positions-broadcast")
    message = " ".join(found[0]["message"].split())
    assert message.startswith("GPT2LMHeadModel was handed input_ids of 4 tokens a row but position_ids of one column")


def test_a_chunked_prefill_handed_each_chunks_first_position_is_found(tmp_path):
    """Written another way: a tiny transformers Llama prefilled in chunks of 4 behind a DynamicCache, each chunk handed
    `[[start]]`; rotary broadcasts the one angle over the chunk. The reference: the first chunk, at position 0, is
    the first said. The fix (arange per chunk) quiet."""
    found = check_bug(tmp_path, "llama_chunked_prefill_start_position_only", "positions-broadcast", HERE)
    assert "(batch row 0: position 0)" in " ".join(found[0]["message"].split())


def _run(positions, ids, queries):
    top = Top("model", arguments={"position_ids": np.asarray(positions), "input_ids": np.asarray(ids)}, first=0, end=1)
    call = SimpleNamespace(index=0, shape=(1, 2, queries, 8), details={}, where="layers.0", step=0)
    return Run([call], [top])


def test_only_one_column_over_tokens_run_together():
    """Said where position_ids is one column, the ids several tokens a row and an attention call runs them together;
    quiet on a column a token, on one token a row, and where the attention ran one query at a time."""
    ids = np.arange(8).reshape(2, 4)
    assert [f.code for _, f in broadcast_positions(_run([[3], [5]], ids, 4))] == ["positions-broadcast"]
    assert broadcast_positions(_run([[0, 1, 2, 3]] * 2, ids, 4)) == []
    assert broadcast_positions(_run([[3], [5]], ids[:, :1], 1)) == []
    assert broadcast_positions(_run([[3], [5]], ids, 1)) == []
