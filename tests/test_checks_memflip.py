"""checks/memflip.py: an attention over a recurrent memory whose queries see only the slots the model call's memory
mask calls invalid (and the memory holds as zeros): caught in the published bug's reproduction (tests/data/bugs) and in
a program written another way (tests/data/memflip), quiet on both fixes; the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first

MEMFLIP = Path(__file__).parent / "data" / "memflip"


def test_nerorl_trxl_memory_mask_filled_where_valid_is_found(tmp_path):
    # MarcoMeter/neroRL 65333f0: masked_fill(attn_mask.T.bool(), -inf) over [4 memory slots | the query]; the first
    # step with a written slot is step 1, whose memory mask is tril(ones(4, 4), -1)[1] = [1, 0, 0, 0]
    found = check_bug(tmp_path, "nerorl_trxl_rel_attention_memory_mask_polarity_inverted", "memory-slots-inverted")
    valid = [1, 0, 0, 0]
    # the buggy kernel: -inf where the mask (plus a 1 for the query itself) is 1, so it sees the slots marked 0
    sees = [1 - v for v in valid] + [0]
    assert tuple(found[0]["cell"]) == first((1, 1, 5), lambda b, q, k: k < 4 and sees[k] and not valid[k])
    assert "`mask` of the model call calls invalid" in found[0]["message"]
    assert "nor key 4 past the slots" in found[0]["message"]


def test_gtrxl_keep_mask_handed_as_key_padding_mask_is_found(tmp_path):
    # written another way: vectorised envs, (E, S, D) memory, nn.MultiheadAttention's key_padding_mask (True = ignore)
    # handed the keep mask; envs have written 1, 0 and 2 of their 4 slots at the first call
    found = check_bug(tmp_path, "gtrxl_vector_envs_memory_mask_as_key_padding", "memory-slots-inverted", folder=MEMFLIP)
    written = (1, 0, 2)

    def bad(b, q, k):  # a key the kernel shows (the key padding hides the written slots and the step itself)
        mixed = 0 < written[b] < 4
        return mixed and k < 4 and k >= written[b]

    assert tuple(found[0]["cell"]) == first((3, 1, 5), bad)
    assert "`memory_mask` of the model call" in found[0]["message"]
