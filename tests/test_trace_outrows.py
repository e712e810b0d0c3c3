"""trace/outrows.py: each row of an outermost call's output hashed, as returned and cast to the half types."""

from __future__ import annotations

import torch

from maskcli.trace.outrows import output_rows
from maskcli.trace.samplerows import sample_rows


def test_a_memory_made_by_repeat_cat_and_a_cast_holds_the_hashes_of_the_output_rows_it_copies():
    torch.manual_seed(0)
    prompts, negative = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    out = {name: output_rows(value)["output_rows"] for name, value in (("pos", (prompts,)), ("neg", negative))}
    memory = torch.cat([negative.repeat_interleave(2, 0), prompts.repeat(1, 2, 1).view(4, 5, 4)]).to(torch.bfloat16)
    rows = dict(sample_rows({"encoder_hidden_states": memory}))["encoder_hidden_states"]
    lookup = {h: (name, row) for name, held in out.items() for hashes in held.values() for row, h in enumerate(hashes)}
    assert [lookup.get(h) for h in rows] == [("neg", 0), ("neg", 0), ("neg", 1), ("neg", 1),
                                             ("pos", 0), ("pos", 0), ("pos", 1), ("pos", 1)]


def test_outputs_that_are_no_hidden_states_are_not_read():
    assert output_rows(torch.randn(2, 5)) == {} and output_rows(None) == {} and output_rows(torch.ones(2, 3, 4).long()) == {}

    class Output(dict):
        pass

    assert set(output_rows(Output(last_hidden_state=torch.randn(1, 3, 2)))["output_rows"]) == {
        "torch.float32", "torch.float16", "torch.bfloat16"}
