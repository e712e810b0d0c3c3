"""checks/globaltokens.py: global tokens (Longformer's attention_mask value 2, a global_attention_mask) that a real
query of their row cannot see; the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first

GLOBAL = Path(__file__).parent / "data" / "globaltokens"


def test_longformer_bart_invert_mask_drops_global_attention(tmp_path):
    """allenai/longformer#28 (written blind): BART's invert_mask turns 1 and 2 alike into False; band |i - j| <= 2,
    token 0 global in both rows, row 1 right-padded from 11."""
    found = check_bug(tmp_path, "longformer_encoder_decoder_bart_invert_mask_drops_global", "global-tokens-unseen")
    assert tuple(found[0]["cell"]) == first((2, 16, 16), lambda b, q, k: k == 0 and abs(q - k) > 2)


def test_a_global_attention_mask_the_layers_never_apply(tmp_path):
    """Written another way: LED's `global_attention_mask` argument (1 = global; token 3 of row 0 too), SDPA handed
    the band over the real tokens alone."""
    found = check_bug(tmp_path, "global_attention_mask_never_applied", "global-tokens-unseen", folder=GLOBAL)
    wide = {(0, 0), (0, 3), (1, 0)}
    lengths = (10, 7)
    assert tuple(found[0]["cell"]) == first((2, 10, 10), lambda b, q, k: q < lengths[b] and k < lengths[b]
                                            and (b, k) in wide and abs(q - k) > 2)


def test_document_numbers_are_not_global_marks():
    """A multipack collator's attention_mask (1, 1, 2, 2, 2: numbers rising along the row) is no global mark; a 2
    before a 1 is; so is a global_attention_mask, its real tokens the attention_mask's."""
    from maskcli.checks.globaltokens import marks

    assert marks({"attention_mask": np.array([[1, 1, 2, 2, 2, 0]])}) is None
    real, wide, name = marks({"attention_mask": np.array([[2, 1, 1, 2, 1, 0]])})
    assert real.tolist() == [[True] * 5 + [False]] and wide.tolist() == [[True, False, False, True, False, False]]
    real, wide, name = marks({"attention_mask": np.array([[1, 1, 0]]), "global_attention_mask": np.array([[1, 0, 1]])})
    assert wide.tolist() == [[True, False, False]] and name == "global_attention_mask"
    assert marks({"attention_mask": np.array([[1, 1, 0]])}) is None
