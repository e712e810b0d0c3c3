"""checks/flexrows.py: a BlockMask of one batch plane whose mask_mod keeps a later row's keys in blocks it never lists."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

FOLDER = Path(__file__).parent / "data" / "flexrows"


def test_decode_block_mask_built_with_b_none(tmp_path):
    """axonn-ai/yalis#53 (written blind, batch blind-ci): the decode BlockMask of `kv_idx <= token_counter[b]` built
    with B=None lists row 0's blocks (a 5-token prompt: block 0 only); row 1's mask_mod (200 cached tokens) keeps keys
    128-200 in block 1, which no list holds. Its fix (B=batch) is quiet."""
    hit = check_bug(tmp_path, "yalis_flex_decode_blockmask_batch_none", "block-mask-one-row")[0]
    counter, block = 200, 128  # row 1's token_counter and the BlockMask's block size: the keys only blocks >= 1 hold
    lost = [k for k in range(384) if k <= counter and k // block >= 1]
    assert tuple(hit["cell"]) == (1, 0, lost[0])
    assert f"keeps keys {lost[0]}-{lost[-1]}" in hit["message"] and f"{len(lost)} such cells" in hit["message"]


def test_packed_documents_block_mask_built_with_b_none(tmp_path):
    """Written another way: a packed training batch's document mask (row 0 two documents of 128, row 1 one of 256)
    built with B=None: row 1's queries 128-255 keep keys 0-127 in a block row 0's lists skip."""
    hit = check_bug(tmp_path, "packed_documents_block_mask_b_none", "block-mask-one-row", FOLDER)[0]
    docs = [[q // 128 for q in range(256)], [0] * 256]
    kept = [(q, k) for q in range(256) for k in range(256)
            if k <= q and docs[1][q] == docs[1][k] and docs[0][q] != docs[0][k]]  # row 1 keeps, row 0's blocks skip
    assert tuple(hit["cell"]) == (1, *kept[0]) and f"{len(kept)} such cells" in hit["message"]
