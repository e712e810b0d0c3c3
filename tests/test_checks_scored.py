"""checks/scored.py: completion tokens a trainer scores, hidden by the attention_mask, against a loop over the rows."""

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first
from maskcli.checks.scored import hidden

SCORED = Path(__file__).parent / "data" / "scored"


def _hidden_scored(mask: list[list[int]], counted: list[list[int]]):
    """bad(b, q, k) of a causal mask and padding from `mask`: a real query after a key the completion mask `counted`
    (over the rows' last tokens) counts but the mask marks 0, where the query sees a real key before it."""
    def bad(b, q, k):
        row, offset = mask[b], len(mask[b]) - len(counted[b])
        scored = k >= offset and counted[b][k - offset] == 1
        before = any(row[j] == 1 for j in range(k))
        return row[q] == 1 and k < q and row[k] == 0 and scored and before
    return bad


def test_a_scored_completion_token_masked_as_padding_is_caught(tmp_path):
    # huggingface/trl#4970 (written blind, batch blind-af): pad == EOS and `completion_ids != pad_token_id` hides each
    # turn's EOS of a multi-turn completion, which the rollout's completion_mask counts
    found = check_bug(tmp_path, "trl_grpo_completion_attention_mask_from_pad_id_multiturn", "scored-token-masked")
    eos = 1  # (the tokenizer's pad id too)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 9]]
    completions = [[12, 13, 14, 1, 30, 31, 32, 15, 16, 1], [17, 18, 1, 33, 34, 19, 1]]
    counted = [[1, 1, 1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 1, 1, 0, 0, 0]]
    mask = [[0] * (5 - len(p)) + [1] * len(p) + [int(t != eos) for t in c] + [0] * (10 - len(c))
            for p, c in zip(prompts, completions)]
    assert tuple(found[0]["cell"]) == first((2, 15, 15), _hidden_scored(mask, counted))
    # written another way: a `response_mask`, the whole mask from `input_ids != pad_id`, an eager additive mask
    found = check_bug(tmp_path, "response_mask_eos_masked_eager", "scored-token-masked", SCORED)
    ids = [[5, 6, 7, 10, 11, 2, 12, 13, 2], [2, 8, 9, 14, 2, 15, 2, 2, 2]]
    counted = [[1] * 6, [1, 1, 1, 1, 0, 0]]
    mask = [[int(t != 2) for t in row] for row in ids]
    assert tuple(found[0]["cell"]) == first((2, 9, 9), _hidden_scored(mask, counted))


def test_zeros_at_a_rows_end_or_unscored_are_left_alone():
    given = np.array([[1, 1, 0, 1, 0, 0]])
    assert hidden(given, np.array([[0, 1, 1, 1]])).tolist() == [[False] * 6]  # (the hole unscored, the end zeros left)
    assert hidden(given, np.array([[1, 1, 1, 1]])).tolist() == [[False, False, True, False, False, False]]
    assert hidden(given, np.ones((2, 4), dtype=np.int64)) is None  # (rows that differ in number)
