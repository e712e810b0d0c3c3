"""checks/emptyreal.py: a query of a self-attention that sees no key though its token is real (rows.py's fully-masked,
wrong there), against cells written by a double loop here and on reproductions of published bugs."""

from __future__ import annotations

import numpy as np

from checkbugs import check_bug
from maskcli.checks.rows import empty_rows
from test_checks_rows import call, cells


def test_a_real_query_that_sees_no_key_by_the_padding_the_program_holds_is_wrong():
    """A self-attention of as many queries as keys whose mask keeps to the padding mask the program holds (no query
    sees a key it calls padding), while a query whose token it calls real sees no key: wrong; the same rows read
    against a mask of the other polarity (the mask lets a query see what it calls padding), or rows of padding that see
    nothing, stay a note."""
    real = np.array([[True, True, True, False], [True, True, True, True]])
    prefix = 2  # keys before it hidden from every query (pi-zero-pytorch 346bb05's `key >= prefix_length`)
    keep = cells(2, 4, 4, lambda b, q, k: k <= q and real[b, k] and k >= prefix)
    held = [{"kind": "keep", "rows": real, "name": "mask", "where": "forward() of prog.py"}]
    found = empty_rows(*call(keep, "flex", held_padding=held), None)
    assert [(f.code, f.severity) for f in found] == [("fully-masked", "wrong")]
    first = next((b, q) for b in range(2) for q in range(4) if real[b, q] and not keep[b, 0, q].any())
    assert found[0].message.startswith(f"query {first[1]} of batch row {first[0]} sees no key at all")
    turned = [{**held[0], "rows": ~real}]  # this padding read as True = real: the mask does not keep to it
    assert [f.severity for f in empty_rows(*call(keep, "flex", held_padding=turned), None)] == ["note"]
    padded = cells(2, 4, 4, lambda b, q, k: k <= q and real[b, k] and real[b, q])  # only the padded query sees nothing
    assert [f.severity for f in empty_rows(*call(padded, "flex", held_padding=held), None)] == ["note"]


def test_pi_zero_flex_mask_hides_the_prefix_from_every_query(tmp_path):
    """lucidrains/pi-zero-pytorch 346bb05 (written blind): the flex mask_fn ANDs `key >= prefix_causal_length` into the
    padded causal mask, so the image and language queries see no key; `mask` (1 = real) in the model's forward calls
    them real and the mask keeps to its padding. The fix ((key_mask & causal) | action block) is quiet."""
    hit = check_bug(tmp_path, "pi_zero_pytorch_flex_mask_blocks_prefix_and_action_bidirectional", "fully-masked")[0]
    assert hit["message"].startswith("query 0 of batch row 0 sees no key at all")


def test_sdpa_prefix_hidden_by_a_suffix_key_term(tmp_path):
    """Written another way: SDPA over separate q, k, v projections, a left-padded prompt between the image and the
    actions, `input_mask` (1 = real) held by the policy's forward; its fix is quiet."""
    from checkbugs import caught

    hit = caught(tmp_path, "sdpa_prefix_hidden_by_suffix_key_term", ("fully-masked",))
    assert "input_mask" in hit["message"]



def test_a_cross_attention_row_whose_whole_context_is_masked_takes_uniform_weights():
    """A cross-attention (6 queries over 4 memory keys) whose key padding hides batch row 1's whole context: with a
    finite fill its real queries read the masked context (wrong); where the kernel gives those rows 0 (SDPA) or the
    program zeroes their output after the product (`zeroed_output`), a note; a batch whose every row is masked is no
    such row (no other row sees its context)."""
    context = np.array([[True, True, True, False], [False, False, False, False]])
    keep = np.zeros((2, 1, 6, 4), dtype=bool)
    for b in range(2):
        for q in range(6):
            for k in range(4):
                keep[b, 0, q, k] = bool(context[b, k])
    finite = {"fill": "finite", "fill_value": -3.4e38}
    memory, stored = call(keep, "softmax", **finite)
    memory.where = "decoder.layers.0.encoder_attn"
    [found] = empty_rows(memory, stored, None)
    assert (found.code, found.severity) == ("fully-masked", "wrong")
    assert found.message.startswith("every query of batch row 1 sees no key of its context at all"), found.message
    for api, details in (("sdpa", {}), ("softmax", {**finite, "zeroed_output": True})):
        other, stored = call(keep, api, **details)
        other.where = "decoder.layers.0.encoder_attn"
        assert [f.severity for f in empty_rows(other, stored, None)] == ["note"], api
    both, stored = call(np.zeros((2, 1, 6, 4), dtype=bool), "softmax", **finite)
    both.where = "decoder.layers.0.encoder_attn"
    assert [f.severity for f in empty_rows(both, stored, None)] == ["note"]


def test_x_transformers_cross_attend_to_a_fully_padded_context(tmp_path):
    # lucidrains/x-transformers#263 (written blind, blind-bz): context_mask all False for sample 1, a finite fill, the
    # softmax spreads its queries over the padded context; the fix zeroes the rows' output (out.masked_fill)
    flagged = check_bug(tmp_path, "x_transformers_cross_attend_fully_padded_context", "fully-masked")
    assert flagged[0]["message"].startswith("every query of batch row 1 sees no key of its context at all"), flagged


def test_media_cross_attention_with_a_sample_that_has_no_image(tmp_path):
    # written another way (tests/data/emptycross/): bmm over (B * heads) matrices, a batch of 3 whose sample 1 has no
    # image; the fix multiplies the output by has_media. Sample 1's two heads are rows 2 and 3 of the folded axis.
    from pathlib import Path

    folder = Path(__file__).parent / "data" / "emptycross"
    flagged = check_bug(tmp_path, "media_cross_attention_sample_without_image", "fully-masked", folder)
    heads, sample = 2, 1
    assert flagged[0]["message"].startswith(f"every query of batch row {sample * heads} sees no key"), flagged


def test_d2l_masked_softmax_over_a_sequence_of_valid_length_zero(tmp_path):
    # d2l-ai/d2l-en#2423 (PR closed unmerged; written blind, blind-cz): masked_softmax folds the (B, Lq, Lk) scores to
    # rows, fills -1e6 past each valid length in place and views them back; sample 2's valid length is 0, so its real
    # queries spread uniform weights over its padded keys. The fix multiplies those rows' weights by 0 after the softmax.
    flagged = check_bug(tmp_path, "d2l_masked_softmax_zero_valid_len_uniform_weights", "fully-masked")
    valid_lens = [6, 3, 0]
    empty = valid_lens.index(0)  # (the reference: the first sample with no valid key)
    assert flagged[0]["message"].startswith(f"every query of batch row {empty} sees no key of its context at all"), flagged
    assert tuple(flagged[0]["cell"]) == (empty, 0, 0), flagged


def test_flattened_scores_of_a_question_that_retrieved_no_passage(tmp_path):
    # written another way (tests/data/emptycross/): (B, H, Lq, Lk) einsum scores flattened to one row per (sample,
    # head, query), filled with -1e9 past each passage length, viewed back; a weightless ScaledDotProduct(query, key,
    # ...) inside a reader with weights; question 1 retrieved nothing. Its heads are not folded into the batch: batch
    # row 1. The fix multiplies the weights by a bool per sample.
    from pathlib import Path

    folder = Path(__file__).parent / "data" / "emptycross"
    flagged = check_bug(tmp_path, "reader_passages_flattened_scores_question_without_passages", "fully-masked", folder)
    lengths = [9, 0, 4]
    assert flagged[0]["message"].startswith(f"every query of batch row {lengths.index(0)} sees no key"), flagged


def test_null_guidance_rows_whose_values_are_zero_read_nothing(tmp_path):
    # written here (tests/data/emptycross/), after quiet-v's MusicGen program: classifier-free guidance's null rows see
    # no key under a finite fill. Their uniform weights read the text's states where the program kept them (wrong: the
    # condition leaks into the unconditional branch); where it zeroed them, as MusicGen does, the bias-free
    # projections make every value they read 0, and the product is 0 there, as zeroing the output would make it.
    from pathlib import Path

    from checkbugs import traced

    folder = Path(__file__).parent / "data" / "emptycross"
    flagged = check_bug(tmp_path, "cfg_null_rows_keep_condition_states", "fully-masked", folder)
    assert flagged[0]["message"].startswith("every query of batch row 2 sees no key of its context at all"), flagged
    _, findings, report = traced(tmp_path, "cfg_null_rows_keep_condition_states", True, folder)
    assert [(f["code"], f["severity"]) for f in findings if f["code"] == "fully-masked"] == [("fully-masked", "note")]
    assert "0 output there (the values those rows read are all 0)" in " ".join(report.split())


def test_a_chunk_of_padding_alone_folded_into_the_batch_is_a_padding_query(tmp_path):
    # hourglass-transformer-pytorch 674ede1's fix (blind-cj): the pooled bucket of padding alone, batch row 7 of
    # `(b n) s`, sees none of its 4 keys under a finite fill; the model call's `mask` (2, 16) read in chunks of 4 says
    # the whole chunk is padding, so its query is padding too: no wrong fully-masked (it was one before). The same
    # read another way: a funnel pooler's left-padded chunks (tests/data/held/).
    from pathlib import Path

    from checkbugs import traced

    for name, folder in (("hourglass_attention_resampling_sees_padding", Path(__file__).parent / "data" / "bugs"),
                         ("chunk_pooling_context_padding_dropped", Path(__file__).parent / "data" / "held")):
        status, found, report = traced(tmp_path, name, True, folder)
        assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
        assert any(f["code"] == "fully-masked" for f in found) or name.startswith("chunk"), report


def test_a_sample_of_padding_alone_is_no_real_row_whose_context_is_masked():
    """A cross-attention batch row that sees no key, where the batch's own `attention_mask` (held where the call ran)
    is 0 throughout: a sample of padding alone (Pop2Piano's separator rows, quiet-r132b), not a real sample whose
    context is masked. The same rows under a `context_mask` (x-transformers#263's name) stay wrong."""
    context = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=bool)
    keep = np.broadcast_to(context[:, None, None, :], (3, 1, 5, 4)).copy()
    finite = {"fill": "finite", "fill_value": -3.4e38}
    for name, severity in (("attention_mask", "note"), ('batch["attention_mask"]', "note"), ("context_mask", "wrong"),
                           ("encoder_attention_mask", "wrong")):
        held = ({"kind": "keep", "name": name, "where": "main()", "rows": context},)
        memory, stored = call(keep, "softmax", held_padding=held, **finite)
        memory.where = "decoder.layers.0.encoder_attn"
        assert [f.severity for f in empty_rows(memory, stored, None)] == [severity], name


def test_a_static_batch_filled_with_rows_of_padding_alone_is_quiet(tmp_path):
    """Written another way (tests/data/emptycross): BART (eager, a finite fill) generates over a batch filled up to 4
    rows with sequences of the pad id alone, attention_mask 0 throughout; the filler rows' decoder queries see no
    encoder key and their output is dropped. Quiet: no fully-masked *wrong*, and the encoder's padding (right-padded
    rows beside rows that keep nothing) is no polarity slip. Before: fully-masked, wrong, and polarity, suspicious."""
    from pathlib import Path

    from checkbugs import traced

    folder = Path(__file__).parent / "data" / "emptycross"
    status, found, report = traced(tmp_path, "static_batch_filler_rows_bart_generate_quiet", False, folder)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert [f for f in found if f["code"] == "fully-masked"], report  # (the rows are still read, and said as a note)
