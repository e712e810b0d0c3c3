"""checks/gathered.py (and trace/gathered.py): a varlen path's keys packed from a padded batch at positions its own mask
marks both ways, on the published bug's reproduction and a program written another way, quiet on their fixes."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug
from maskcli.trace import gathered
from maskcli.trace.masks import Seen

GATHERED = Path(__file__).parent / "data" / "gathered"


def _expected(mask: list[list[int]], taken_of) -> list[tuple[int, list[int], list[int]]]:
    """(row, positions taken, positions the mask keeps) of each row whose taken positions mix kept and masked ones, by a
    loop over positions (the reference)."""
    out = []
    for b, row in enumerate(mask):
        taken = taken_of(b)
        marks = {row[p] for p in taken}
        if marks == {0, 1}:
            out.append((b, taken, [p for p in range(len(row)) if row[p]]))
    return out


def _flagged(found: list[dict]) -> list[tuple[int, str]]:
    return [(f["cell"][0], f["message"]) for f in found]


def test_diffusers_fa3_varlen_hub_mask_taken_as_key_prefix(tmp_path):
    """huggingface/diffusers#14115: the FA3 varlen backend packs `key[b, :attn_mask.sum()]`, a prefix, for a [text,
    image] mask whose text padding sits in the middle (written blind, batch blind-x; missed before). Its fix packs the
    keys at the mask's nonzero positions: quiet."""
    found = check_bug(tmp_path, "diffusers_fa3_varlen_hub_mask_taken_as_key_prefix", "keys-gathered-across-mask")
    text = [[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]]
    mask = [row + [1] * 4 for row in text]  # (ones for the 4 image tokens)
    want = _expected(mask, lambda b: list(range(sum(mask[b]))))
    assert [b for b, _ in _flagged(found)] == [b for b, _, _ in want] == [0, 1]
    assert "positions 0-5), but attn_mask of _flash_attention_3_varlen_hub() marks 0-1 of them" in found[0]["message"]
    assert "positions 6-9, marked as the first, are left out" in found[0]["message"]


def test_a_left_padded_batch_unpadded_by_a_prefix_is_found(tmp_path):
    """Written another way (tests/data/gathered): (B, H, L, D) keys, a 0/1 integer attention_mask padded on the left,
    each row's first attention_mask.sum() tokens run alone through SDPA. The fix indexes by the mask: quiet."""
    found = check_bug(tmp_path, "left_padded_prefix_unpad", "keys-gathered-across-mask", folder=GATHERED)
    mask = [[1] * 7, [0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]]
    want = _expected(mask, lambda b: list(range(sum(mask[b]))))
    assert sorted(b for b, _ in _flagged(found)) == [b for b, _, _ in want] == [1, 2]
    first_masked = {b: next(p for p in taken if not mask[b][p]) for b, taken, _ in want}
    assert all(f["cell"][2] == first_masked[f["cell"][0]] for f in found)


def _noted(key: torch.Tensor, attn_mask: torch.Tensor, taken: list[int], b: int) -> dict | None:
    """trace/gathered.note at a kernel handed key[b, taken] (one sequence, (1, H, n, D)), with `key` (B, L, H, D) and
    `attn_mask` held by this frame, as a varlen path holds them."""
    seen = Seen("sdpa", (1, key.shape[2], len(taken), len(taken)), (), (), (), "float32", "cpu")
    gathered.note(seen, key[b, taken].transpose(0, 1)[None])
    return seen.details.get("gathered_keys")


def test_a_gather_that_follows_the_mask_either_way_round_is_quiet():
    """Right padding taken as a prefix, the mask's nonzero positions, and the masked ones (True = padding, read the
    other way round) gather keys of one mark: nothing recorded. A prefix over left padding mixes them: recorded, with
    the positions taken."""
    torch.manual_seed(0)
    key = torch.randn(2, 6, 2, 4)
    attn_mask = torch.tensor([[True] * 6, [True, True, True, True, False, False]])
    assert _noted(key, attn_mask, [0, 1, 2, 3], 1) is None  # (right padding: the prefix is the kept keys)
    assert _noted(key, attn_mask, [4, 5], 1) is None  # (the other mark throughout: follows the mask read True = padding)
    attn_mask = attn_mask.flip(-1)  # left padding: kept keys 2-5
    got = _noted(key, attn_mask, [0, 1, 2, 3], 1)
    assert got is not None and (got["row"], got["taken"], got["marked"]) == (1, [0, 1, 2, 3], [2, 3, 4, 5])


def test_keys_of_a_dtype_numpy_lacks_are_matched_by_their_bytes():
    """bfloat16 and float8 keys (numpy has no type for them) gathered by a prefix over left padding are found as float32
    ones are; the same gather over right padding is quiet."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float16):
        key = torch.randn(2, 6, 2, 4).to(dtype)
        attn_mask = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
        got = _noted(key, attn_mask, [0, 1, 2, 3], 1)
        assert got is not None and (got["row"], got["taken"], got["marked"]) == (1, [0, 1, 2, 3], [2, 3, 4, 5]), dtype
        attn_mask = attn_mask.flip(-1)  # (right padding: the prefix is the kept keys; this frame holds that mask now)
        assert _noted(key, attn_mask, [0, 1, 2, 3], 1) is None, dtype


def _merged(lengths: list[int], causal: bool = True) -> tuple[int, int, int, int]:
    """(first query, first key, their row and the count) of the cells where a query of one row sees a key of another
    when the rows' tokens are packed one after another into one (causal) attention: a double loop over the packed
    positions (the reference)."""
    rows = [b for b, n in enumerate(lengths) for _ in range(n)]
    cells = [(i, j) for i in range(len(rows)) for j in range(len(rows)) if rows[i] != rows[j] and (j <= i or not causal)]
    return cells[0][0], cells[0][1], rows[cells[0][0]], len(cells)


def test_cehrgpt_left_padded_batch_taken_for_a_sample_pack_merges_two_patients(tmp_path):
    """knatarajan-lab/cehrgpt d834e07 (written blind, blind-ht, round 53; missed before): `is_sample_pack` reads a
    left-padded batch as packed, so `_get_unpad_data` cuts the flattened mask at its zeros and one varlen segment holds
    both rows' tokens; the flash stand-in runs bf16 keys cast back to float32 (matched through that cast). Its fix
    flips a left-padded mask first: a segment per row, quiet."""
    [hit] = check_bug(tmp_path, "cehrgpt_flash_left_padded_batch_taken_for_sample_pack", "keys-of-another-row")
    query, key, row, count = _merged([7, 10])
    assert hit["cell"][1:] == [query, key] and f"{count} such cells" in hit["message"]
    assert f"its query {query} (batch row {row}, position 0)" in hit["message"]
    assert "attention_mask of forward() holds those rows apart" in hit["message"]


def test_varlen_segments_from_the_total_token_count_merge_right_padded_rows(tmp_path):
    """Written another way: a right-padded batch unpadded by index_select, cu_seqlens `[0, mask.sum()]` (one segment),
    the stand-in's SDPA is_causal=True over (H, n, D); its fix, a segment per row, is checked against each row alone."""
    [hit] = check_bug(tmp_path, "right_padded_varlen_cu_seqlens_from_total_merges_rows", "keys-of-another-row", GATHERED)
    query, key, _, count = _merged([5, 3])
    assert hit["cell"][1:] == [query, key] and f"{count} such cells" in hit["message"]


def test_keys_of_several_rows_under_a_mask_that_keeps_them_apart_are_not_said():
    """A block-diagonal mask over the packed rows (each query its own row's keys) says nothing; an open one does."""
    keys = torch.randn(2, 3, 2, 4)  # (B, L, H, D) padded
    attention_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # noqa: F841 - read from this frame by gathered.note
    packed = keys.reshape(6, 2, 4)[torch.tensor([0, 1, 3, 4, 5])].transpose(0, 1)  # (H, 5, D)
    apart = torch.zeros(5, 5, dtype=torch.bool)
    apart[:2, :2] = apart[2:, 2:] = True
    for kept, said in ((apart.numpy(), False), (None, True)):
        seen = Seen("sdpa", (1, 2, 5, 5), (2, 5, 4), (2, 5, 4), (2, 5, 4), "float32", "cpu")
        gathered.note(seen, packed, kept)
        assert ("gathered_rows" in seen.details) is said, seen.details
