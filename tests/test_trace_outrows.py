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


def test_a_returned_forward_s_locals_are_hashed_where_its_return_was_not_seen():
    import sys

    from maskcli.trace.outrows import returned_rows

    frames = []

    def forward(ids):
        hidden = torch.arange(ids.numel() * 4, dtype=torch.float32).view(*ids.shape, 4) + ids[..., None]
        other = torch.zeros(3, 2, 4)  # (another batch size: left out, the forward's own batch is most of them)
        frames.append(sys._getframe())
        hidden = hidden * 2
        return hidden, other

    out, _ = forward(torch.tensor([[1, 2, 0], [3, 0, 0]]))
    held = returned_rows(frames[0])["output_rows"]
    reference = tuple(hash(row.numpy().tobytes()) for row in out)  # (each row's bytes, as a copy of it keeps them)
    assert held["hidden:torch.float32"] == reference and len(held["hidden:torch.bfloat16"]) == 2
    assert not any(name.startswith("other:") for name in held)
    assert returned_rows(sys._getframe()) == {}  # (a frame still running: nothing read)


def test_a_greedy_decoder_s_own_padded_self_attention_is_not_read_as_its_encoder_s(tmp_path):
    """nlp-tutorial's Transformer (graykode/nlp-tutorial#17), decoded greedily: the encoder is called with its ids
    alone (no mask handed: its first call's return is not watched), then the decoder once per step over a target whose
    undecoded slots hold the pad id. At step 0 the decoder's self-attention keeps only the start token, from every
    query: read as the memory's padding, the fix's correct cross-attention mask was told encoder-padding-ignored. The
    encoder's first call's output is now hashed from its forward's locals, the memory matched to it by content, and
    its own self-attention read: the fix quiet, the bug (the inverted subsequent mask) still caught."""
    from checkbugs import check_bug

    check_bug(tmp_path, "nlp_tutorial_greedy_decoder_subsequent_mask_polarity", "decoder-mask-not-causal")


def test_a_greedy_decode_over_pad_filled_target_slots_with_the_source_padding_handed_is_quiet(tmp_path):
    """The same shape written another way (SDPA with bool masks, a batch of two sources of lengths 6 and 4, the
    program checking each row against the row decoded alone): quiet."""
    from pathlib import Path

    from checkbugs import traced

    folder = Path(__file__).parent / "data" / "memory"
    status, found, report = traced(tmp_path, "greedy_decoder_pads_undecoded_slots_encoder_handed_ids_quiet", False, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
