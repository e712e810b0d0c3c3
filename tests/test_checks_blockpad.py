"""checks/blockpad.py: the padding the program holds, over attention computed in blocks (N, blocks, size, size), caught
in the published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/blockpad),
quiet on both fixes; the flagged cell against a double loop over token positions."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first

BLOCKPAD = Path(__file__).parent / "data" / "blockpad"


def test_h_transformer_1d_model_forward_drops_padding_mask(tmp_path):
    """lucidrains/h-transformer-1d 4e7f4fc: HTransformer1D.forward calls `self.layers(x)` without `mask`, so no level
    of the hierarchical attention masks the padding (written blind, batch blind-da; missed before: the scores are
    (batch * heads, blocks, 2, 2), no (L, L) to lay the padding on). Fix (`self.layers(x, mask=mask)`) quiet.
    The cell: the batch of 2 folded with 2 heads (row 2 is sample 1, head 0), a real query that sees, in its own block
    of 2, a key past the sample's 11 tokens."""
    [hit] = check_bug(tmp_path, "h_transformer_1d_model_forward_drops_padding_mask", "padding-unused-in-blocks")
    assert "mask (forward() of" in hit["message"] and "row 2 of the 4" in hit["message"]
    lengths, heads = (16, 11), 2
    real = lambda b, t: t < lengths[b // heads]  # noqa: E731  (repeat_interleave: row b is sample b // heads)
    assert tuple(hit["cell"]) == first((4, 16, 16), lambda b, q, k: q // 2 == k // 2 and real(b, q) and not real(b, k))


def test_a_blockwise_local_encoder_layer_that_drops_its_key_padding_mask_is_found(tmp_path):
    """Written another way (tests/data/blockpad): a speech-style encoder's blockwise local attention, blocks of 4 over a
    left-padded batch of three, `src_key_padding_mask` (True = padding) handed to each layer, which calls its
    attention without it. The fix masks the padding in each block: quiet."""
    [hit] = check_bug(tmp_path, "blockwise_local_encoder_layer_drops_key_padding_mask", "padding-unused-in-blocks",
                      folder=BLOCKPAD)
    assert "src_key_padding_mask (forward() of" in hit["message"]
    frames, t, heads, block = (16, 10, 13), 16, 2, 4
    real = lambda b, i: i >= t - frames[b // heads]  # noqa: E731
    assert tuple(hit["cell"]) == first((6, t, t), lambda b, q, k: q // block == k // block and real(b, q) and not real(b, k))


def test_blocks_are_read_as_their_own_or_their_siblings_keys_against_a_double_loop():
    import numpy as np

    from maskcli.checks.blockpad import _real

    real = np.array([[1, 1, 1, 1, 1, 0, 0, 0]], bool)
    for flip in (False, True):
        table = _real(real, 2, 4, flip)
        for n in range(4):
            for i in range(2):
                assert table[0, n, i] == real[0, (n ^ 1 if flip else n) * 2 + i]
