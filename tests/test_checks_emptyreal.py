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

