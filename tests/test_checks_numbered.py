"""checks/numbered.py: packed samples numbered in the model call's attention_mask, against a loop over the numbers."""

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first, traced
from maskcli.checks.context import Top
from maskcli.checks.numbered import samples

PACKED = Path(__file__).parent / "data" / "packed"


def _sample(row: list[int], t: int) -> int:
    """The sample of token t: how many runs of one nonzero number begin at or before it (a plain loop)."""
    runs = 0
    for j in range(t + 1):
        if row[j] != 0 and (j == 0 or row[j] != row[j - 1]):
            runs += 1
    return runs


def _causal_across(numbers: list[list[int]]):
    """bad(b, q, k) of a causal mask over whole rows: a real query sees a real key of another sample."""
    def bad(b, q, k):
        row = numbers[b]
        return k <= q and row[q] != 0 and row[k] != 0 and _sample(row, q) != _sample(row, k)
    return bad


def _segment_cells(numbers: list[list[int]], lengths: list[int]) -> list[tuple[int, int, int]]:
    """(first real token, q, k) of each causal segment of `lengths` over the real tokens flattened that spans
    samples: its first cell where a query sees an earlier key of another sample."""
    flat = [(b, _sample(row, t)) for b, row in enumerate(numbers) for t in range(len(row)) if row[t] != 0]
    found, start = [], 0
    for n in lengths:
        seg = flat[start:start + n]
        cell = next(((q, k) for q in range(n) for k in range(q + 1) if seg[q] != seg[k]), None)
        if cell is not None:
            found.append((start, *cell))
        start += n
    return found


def test_numbered_samples_a_row_attends_whole_is_caught(tmp_path):
    # OpenRLHF 15517919 (written blind, batch blind-af): chosen and rejected packed into two rows of equal length leave
    # no 0 in the numbered mask, transformers 4.42's flash path drops it, and each row runs causal over every sample
    found = check_bug(tmp_path, "openrlhf_rm_packing_samples_mask_without_zero_dropped", "samples-leak")
    numbers = [[1] * 5 + [2] * 7, [1] * 6 + [2] * 6]
    assert tuple(found[0]["cell"]) == first((2, 12, 12), _causal_across(numbers))
    # written another way: nn.MultiheadAttention handed the numbers as a key padding mask only, rows padded at the end
    found = check_bug(tmp_path, "numbered_samples_mha_padding_only", "samples-leak", PACKED)
    numbers = [[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 2, 2, 3, 3, 3, 3]]
    assert tuple(found[0]["cell"]) == first((2, 8, 8), _causal_across(numbers))


def test_numbered_samples_segments_off_the_runs_are_caught(tmp_path):
    # OpenRLHF e98d0cbd (written blind, batch blind-af): rejected sample i reused chosen sample i + 2's number, and the
    # varlen segments counted per number span two samples each
    found = check_bug(tmp_path, "openrlhf_dpo_packing_rejected_segment_ids_collide", "samples-leak")
    numbers = [[1] * 7 + [2] * 7 + [3] * 6 + [4] * 6 + [3] * 6 + [4] * 4 + [5] * 8 + [6] * 8]
    counts = [sum(row.count(n) for row in numbers) for n in range(1, 7)]
    expected = _segment_cells(numbers, counts)
    assert expected and all("from real token" in f["message"] for f in found)
    assert {tuple(f["cell"][1:]) for f in found} == {cell[1:] for cell in expected}
    # written another way: each row numbers its samples from 1, the lengths counted over the whole batch (bincount)
    found = check_bug(tmp_path, "numbered_samples_counted_over_batch", "samples-leak", PACKED)
    numbers = [[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]]
    counts = [sum(row.count(n) for row in numbers) for n in (1, 2)]
    assert (0, *found[0]["cell"][1:]) == _segment_cells(numbers, counts)[0]


def test_a_plain_padding_mask_numbers_no_samples():
    assert samples(Top("m", arguments={"attention_mask": np.array([[0, 1, 1], [1, 1, 1]])})) is None
    labels, _ = samples(Top("m", arguments={"attention_mask": np.array([[1, 2, 2, 1, 0]])}))
    assert labels.tolist() == [[0, 1, 1, 2, -1]]  # (a number met again after another is another sample)


def test_per_sample_calls_that_follow_the_runs_are_quiet(tmp_path):
    status, found, _ = traced(tmp_path, "openrlhf_dpo_packing_rejected_segment_ids_collide", True)
    assert status == 0 and not [f for f in found if f["code"] == "samples-leak"]


def test_functionary_packing_patch_set_where_flash_attention_no_longer_looks(tmp_path):
    """MeetKai/functionary 2b6d23e (written blind, batch blind-mu; caught before any rule changed for it): the packing
    monkey-patch replaced modeling_llama's `_get_unpad_data`, which transformers' flash-attention helpers no longer
    call, so the numbered mask was read as a plain 0/1 mask and packed data points attended each other. The fix
    patches modeling_flash_attention_utils."""
    hit = check_bug(tmp_path, "functionary_packing_monkey_patch_misses_flash_attention_utils", "samples-leak")[0]
    assert "numbers packed samples (row 0: [1 x 5, 2 x 4, 0 x 3])" in " ".join(hit["message"].split())
