"""checks/placedpads.py (fed by trace/placedids.py): a real query that sees a key holding a pad token of ids whose
embeddings the layer gets at known keys of a joined sequence, on a reproduction of a published bug (pi-zero's
language mask padded out one key left, right padding, an eager softmax) and on a program written otherwise
(registers, a left-padded instruction and a state token through nn.MultiheadAttention's key_padding_mask), both fixes
quiet; pad_keys against a loop over rows and tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.placedpads import pad_keys

PLACED = Path(__file__).parent / "data" / "placed"


def test_pi_zero_language_pad_mask_offset_by_one_is_flagged_and_its_fix_is_not(tmp_path):
    # lucidrains/pi-zero-pytorch#12 (fixed in 6716ce2): F.pad(language_mask, (state_length - command_length - 1,
    # 1 + actions)) shifts the mask one key left: the last pad token attended, a real one hidden
    hit = check_bug(tmp_path, "pi_zero_pytorch_language_pad_mask_offset_by_one", "placed-pads-seen")[0]
    assert "batch row 1" in hit["message"] and "key 9" in hit["message"] and "keys 4-9" in hit["message"]


def test_register_tokens_left_padded_prompt_mask_on_the_wrong_side_is_flagged_and_the_fix_is_not(tmp_path):
    hit = check_bug(tmp_path, "register_tokens_left_padded_prompt_mask_wrong_side", "placed-pads-seen", PLACED)[0]
    assert "keys 2-6" in hit["message"] and "pad id 0" in hit["message"]


def test_pad_keys_match_a_loop_over_rows_and_tokens():
    rng = np.random.default_rng(1)
    for _ in range(200):
        rows, width = int(rng.integers(1, 4)), int(rng.integers(2, 6))
        ids = rng.integers(0, 4, size=(rows, width))
        offset, n = int(rng.integers(0, 3)), width + int(rng.integers(2, 5))
        k_len = n + int(rng.integers(0, 4))
        start = int(rng.choice([0, k_len - n]))
        got = pad_keys({"ids": ids, "pad": 0, "offset": offset, "width": n}, k_len, start)
        want = np.zeros((rows, k_len), dtype=bool)
        for b in range(rows):
            for t in range(width):
                want[b, start + offset + t] = ids[b, t] == 0
        assert (got == want).all()
