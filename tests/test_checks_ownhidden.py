"""checks/ownhidden.py: a self-attention whose queries never see their own token while seeing keys apart from it.
Paddle3D#235 and titans-pytorch 8902334 (written blind, round 51) and the same slip written another way (a local
window's blocked cells handed to SDPA as kept ones), the fixes quiet; the first flagged query against a loop over
the masks the programs build; the masks hiding a query's own token on purpose left alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from checkbugs import check_bug, traced
from maskcli.checks.ownhidden import _read

OWNHIDDEN = Path(__file__).parent / "data" / "ownhidden"


def _first_apart(sees, q_len: int, k_len: int, own) -> tuple[int, list[int]]:
    """The first query (by a loop) that does not see its own key `own(q)` and whose seen keys with it are not one run,
    and the keys it sees."""
    for q in range(q_len):
        keys = [k for k in range(k_len) if sees(q, k)]
        joined = sorted(set(keys) | {own(q)})
        if own(q) not in keys and keys and joined != list(range(joined[0], joined[-1] + 1)):
            return q, keys
    raise AssertionError("no such query")


def test_paddle3d_dn_detr_group_mask_read_the_other_way_round(tmp_path):
    # Paddle3D#235: mmcv's torch-style group mask (True = blocked) handed to Paddle's MultiHeadAttention, True = attend
    [hit] = check_bug(tmp_path, "paddle3d_multihead_attention_torch_bool_attn_mask_not_inverted", "own-token-hidden")
    groups, gt, matching = 2, 3, 5
    pad = groups * gt

    def blocked(q, k):  # DN-DETR's mask as mmdet builds it: True where a query may not look
        if q >= pad:
            return k < pad
        return k < pad and k // gt != q // gt
    q, keys = _first_apart(lambda q, k: blocked(q, k), pad + matching, pad + matching, lambda q: q)
    assert tuple(hit["cell"]) == (0, q, q)
    assert hit["message"].startswith(f"batch row 0: query {q} sees keys {keys[0]}-{keys[-1]} but not key {q}, its own")


def test_titans_mac_mask_mod_shifted_by_a_bool_not_the_memory_length(tmp_path):
    # lucidrains/titans-pytorch 8902334: `kv_idx - is_persist_mem` for `kv_idx - persist_mem_len`; 4 persistent
    # memory keys before the 24 tokens, windows of 4 (segment_len)
    [hit] = check_bug(tmp_path, "titans_mac_flex_mask_offsets_keys_by_bool_not_persist_len", "own-token-hidden")
    memory, window, length = 4, 4, 24

    def sees(q, k):  # the buggy mask_mod, by a loop
        if k < memory:
            return True
        return q >= k - 1 and q // window == (k - 1) // window
    q, keys = _first_apart(sees, length, length + memory, lambda q: q + memory)
    assert tuple(hit["cell"]) == (0, q, q + memory)
    assert f"query {q} sees keys 0-3 but not key {q + memory}, its own token" in hit["message"]


def test_a_local_windows_blocked_cells_handed_to_sdpa_as_kept(tmp_path):
    [hit] = check_bug(tmp_path, "local_window_blocked_mask_handed_to_sdpa_as_kept", "own-token-hidden", OWNHIDDEN)
    window = 3
    q, keys = _first_apart(lambda q, k: k > q or q - k >= window, 10, 10, lambda q: q)
    assert (q, keys[0]) == (3, 0)
    assert "query 3 sees keys 0, 4-9 but not key 3, its own token" in hit["message"]
    assert "(10 such queries" in hit["message"]


def _call(cells: np.ndarray):
    return SimpleNamespace(shape=(cells.shape[0], 1, *cells.shape[1:]), details={})


def _square(length: int, sees) -> np.ndarray:
    return np.array([[[sees(q, k) for k in range(length)] for q in range(length)]])


@pytest.mark.parametrize("name, sees", [
    ("strictly causal (PixelSNAIL's first block)", lambda q, k: k < q or q == k == 0),
    ("strictly causal, the first row empty", lambda q, k: k < q),
    ("leave-one-out (SAITS's diagonal masking)", lambda q, k: k != q),
    ("leave-one-out over 4 real tokens of 6", lambda q, k: k != q and k < 4),
    ("a graph's adjacency without self-loops", lambda q, k: abs(q - k) in (1, 3)),
    ("a key mask alone", lambda q, k: k >= 2),
    ("causal", lambda q, k: k <= q),
    # (RetroMAE's enhanced decoder, quiet-r94a: each position hides its own token and a sample of whole words, drawn
    # per position; query 0 hides itself alone between keys it sees)
    ("its own token and a sample of words per position", lambda q, k: k != q and (k - q) % 6 not in (3, 4)),
])
def test_masks_that_hide_a_querys_own_token_on_purpose_are_left_alone(name, sees):
    cells = _square(6, sees)
    assert _read(_call(cells), None, cells, False) is None, name


def test_a_shifted_causal_window_is_flagged_and_the_same_window_placed_right_is_not():
    shifted = _square(8, lambda q, k: q - 4 < k <= q - 2)  # each query sees the two keys before last
    assert _read(_call(shifted), None, shifted, False).code == "own-token-hidden"
    placed = _square(8, lambda q, k: q - 2 < k <= q)
    assert _read(_call(placed), None, placed, False) is None


def test_keys_before_the_queries_place_them_only_where_every_query_sees_them_or_a_cache_says_so():
    memory, length = 2, 6
    cells = np.array([[[k < memory or memory <= k < q + memory - 1 and k >= q for k in range(memory + length)]
                       for q in range(length)]])
    cells[0, 0, 2:] = False
    partial = cells.copy()
    partial[:, :, 1] = False  # (a key before the queries some query does not see: their places unknown)
    assert _read(_call(cells), None, cells, False) is not None
    assert _read(_call(partial), None, partial, False) is None
    assert _read(_call(partial), None, partial, True) is not None


def test_positions_counted_from_pad_plus_one_over_cache_slots_from_zero_quiet(tmp_path):
    """alpa-projects/alpa#608's fix, written blind (blind-nb; still a miss, so in tests/data/blind): OPT numbers its
    tokens `cumsum(mask) * mask + padding_idx` (2..10) over cache slots written from 0, and the causal prompt pass
    through the cache was read as every query hiding its own token (key 2 for query 0). Every attending query sees
    the key 2 before its stated position: the positions count from 2, the mask keeps to the tokens."""
    status, found, report = traced(tmp_path, "alpa_opt_serving_cached_prompt_bias_not_causal", True,
                                   Path(__file__).parent / "data" / "blind")
    assert [f["code"] for f in found if f["severity"] == "wrong"] == [] and status == 0, report
