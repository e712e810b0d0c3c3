"""checks/headrows.py: a head of one batch row that carries another row's padding (repeat for repeat_interleave)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first, traced

HELD = Path(__file__).parent / "data" / "held"


def test_lighthouse_attn_mask_repeat_tiles_batch(tmp_path):
    """line/lighthouse#77: a video-clip x text mask tiled over heads with .repeat(nhead, 1, 1)."""
    check_bug(tmp_path, "lighthouse_t2v_attn_mask_repeat_tiles_batch", "mask-of-another-row")


def test_lighthouse_cg_detr_attn_mask_repeat_tiles_batch(tmp_path):
    """line/lighthouse#77 (written blind, batch blind-dn): CG-DETR's T2V encoder, a (B * nhead) mask of the clips'
    and words' padding outer product tiled with .repeat(nhead, 1, 1)."""
    check_bug(tmp_path, "lighthouse_cg_detr_t2v_encoder_attn_mask_repeat_tiles_batch", "mask-of-another-row")


def test_region_mask_repeated_over_heads(tmp_path):
    """Written another way: batch_first, two heads, a grounding mask whose first token reads every slot (so no head
    hides a key from every query: heads.py's rule has nothing to say); the first cell is a double loop's over what
    nn.MultiheadAttention masks for row 1's head 0 (sample 0's mask, by repeat's index) and not for its head 1."""
    status, found, report = traced(tmp_path, "region_mask_repeated_over_heads", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "mask-of-another-row")
    pad = [[0, 0, 0, 1, 1], [0] * 5]
    sample = lambda s, q, k: q > 0 and bool(pad[s][k])  # noqa: E731 - sample s's grounding mask, True = masked
    hidden = lambda b, h, q, k: bool(pad[b][k]) or sample((b * 2 + h) % 2, q, k)  # noqa: E731 - with the key padding
    assert tuple(hit["cell"]) == first((2, 3, 5), lambda b, q, k: hidden(b, 0, q, k) and not hidden(b, 1, q, k))
    status, found, report = traced(tmp_path, "region_mask_repeated_over_heads", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_streaming_chunk_mask_expanded_head_major(tmp_path):
    """Written another way: sequence-first MHA, three right-padded utterances under a streaming chunk mask whose real
    frames alone are masked against padding, made per head by unsqueeze(0).expand(heads, ...).reshape (head-major,
    repeat's order); the first cell is a double loop's over what MHA masks at b * heads + h, key padding merged."""
    status, found, report = traced(tmp_path, "streaming_chunk_mask_expanded_head_major", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "mask-of-another-row" and f["severity"] == "wrong")
    lengths, heads = [8, 5, 6], 4
    own = lambda s, q, k: k // 2 > q // 2 or (q < lengths[s] <= k)  # noqa: E731 - utterance s's mask, True = masked
    hidden = lambda b, h, q, k: k >= lengths[b] or own((b * heads + h) % 3, q, k)  # noqa: E731 - as MHA reads it
    assert tuple(hit["cell"]) == first((3, 8, 8), lambda b, q, k: len({hidden(b, h, q, k) for h in range(heads)}) == 2)
    status, found, report = traced(tmp_path, "streaming_chunk_mask_expanded_head_major", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_megatron_ul2_prefix_lm_mask_missing_head_axis(tmp_path):
    """bigcode-project/Megatron-LM commit 324d70d (written blind, batch blind-dq): the decoder-only UL2 prefix-LM
    dec_mask (B, s, s) reached masked_fill_ on (B, heads, s, s) scores without its head axis, with B == heads: head h
    of every row ran with sample h's mask. Said as that row's mask, not as the held mask ignored (held-mask-ignored
    left out); the first cell is row 0's head 1 (sample 1's prefix of 4 over sample 0's of 10), by a double loop."""
    found = check_bug(tmp_path, "bigcode_megatron_ul2_decoder_only_prefix_lm_mask_missing_head_axis",
                      "mask-of-another-row")
    prefix = [10, 4]
    shows = lambda s, q, k: k <= q or (q < prefix[s] and k < prefix[s])  # noqa: E731 - sample s's dec_mask, True = keep
    assert tuple(found[0]["cell"]) == first((1, 16, 16), lambda b, q, k: shows(b, q, k) != shows(1, q, k))
    _, every, _ = traced(tmp_path, "bigcode_megatron_ul2_decoder_only_prefix_lm_mask_missing_head_axis", False)
    assert "held-mask-ignored" not in {f["code"] for f in every}


def test_streaming_chunk_masks_missing_head_axis(tmp_path):
    """Written another way: a streaming speech encoder's (B, T, T) chunk_masks (True = may attend, padding frames
    hidden) laid on (B, heads, T, T) scores by masked_fill(~mask) without unsqueeze(1), B == heads, so head h of every
    utterance runs with utterance h's chunks and padding; the first cell is a double loop's over the first head that
    runs with another row's. The padded keys it sees are said by this rule alone (padding-unused left out)."""
    status, found, report = traced(tmp_path, "streaming_chunk_masks_missing_head_axis", False, HELD)
    assert status == 1, report
    assert [f["code"] for f in found if f["severity"] == "wrong"] == ["mask-of-another-row"], report
    lengths, size, heads = [9, 5, 7], 9, 3
    keeps = lambda b, q, k: q == k or (k < min((q // 3 + 1) * 3, size) and k < lengths[b])  # noqa: E731 - row b's
    want = next((b, q, k) for b in range(3) for h in range(heads) for q in range(size) for k in range(size)
                if keeps(b, q, k) != keeps(h, q, k))  # (head h of row b runs with row h's mask)
    assert tuple(found[0]["cell"]) == want
    status, found, report = traced(tmp_path, "streaming_chunk_masks_missing_head_axis", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_heads_with_their_own_windows_are_quiet():
    """Local and global heads alternating (a design, not a bug) over a right-padded batch: the cells a local head
    hides are far keys, real in every row, so no row's padding explains them."""
    from maskcli.checks.headrows import _finding

    lengths, heads, size = [3, 5], 4, 5
    cells = np.zeros((2, heads, size, size), dtype=bool)
    for b in range(2):
        for h in range(heads):
            for q in range(size):
                for k in range(size):
                    cells[b, h, q, k] = k <= q and k < lengths[b] and (h % 2 == 1 or q - k < 2)
    real = np.array([[k < n for k in range(size)] for n in lengths])
    assert _finding(cells, 2, heads, real) is None
    # every head causal alike, then row 0's padding laid on row 1's heads 0 and 2 (repeat's index 4 % 2 == 0, 6 % 2)
    alike = np.broadcast_to(np.tril(np.ones((size, size), dtype=bool)) & real[:, None, None, :], cells.shape).copy()
    assert _finding(alike, 2, heads, real) is None
    swapped = alike.copy()
    swapped[1, ::2] &= real[0][None, None, :]
    found = _finding(swapped, 2, heads, real)
    assert found is not None and found.code == "mask-of-another-row"
    want = first((1, size, size), lambda _, q, k: bool(alike[1, 0, q, k] and not swapped[1, 0, q, k]))
    assert found.cell == (1, want[1], want[2])
