"""checks/chunkahead.py: a streaming encoder's chunk whose outputs, through every layer's mask, depend on frames past
the right context the model states; the reference is the dependence worked out by a double loop over positions,
layer after layer."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

CHUNKAHEAD = Path(__file__).parent / "data" / "chunkahead"


def reached(t: int, size: int, rights: list, length: int) -> list[set]:
    """For each frame, the real frames its output depends on after layers whose chunk masks give `rights[i]` frames of
    right context (query q sees every real key up to its chunk's end plus that), by loops over positions."""
    deps = [{q} for q in range(t)]
    for right in rights:
        deps = [set().union(*(deps[k] for k in range(t) if k < length and k <= (q // size + 1) * size - 1 + right))
                for q in range(t)]
    return deps


def test_neural_sp_right_context_on_every_layer(tmp_path):
    """neural_sp#121 (written blind, batch blind-ar): N_c 4, N_r 2, 3 layers all given the right context; frame 0's
    output depends on frames up to 11, and the first past its chunk's 0-3 + 2 is 6."""
    [hit] = check_bug(tmp_path, "neural_sp_streaming_mask_right_context_every_layer", "chunk-lookahead-compounds")
    deps = reached(16, 4, [2, 2, 2], 16)  # (batch row 0, unpadded; the left limit of 4 does not bind frame 0)
    first = min(k for k in deps[0] if k > 3 + 2)
    assert hit["cell"] == [0, 0, first] and "chunk of 4 with 2 frames" in hit["message"], hit
    assert max(deps[0]) > 5 and max(reached(16, 4, [2, 0, 0], 16)[0]) == 5  # (the fix: 5 at most)


def test_multihead_attention_chunks_over_a_padded_batch(tmp_path):
    """Written another way: nn.MultiheadAttention with a (B * heads, T, T) bool mask, chunks of 3, 1 frame of right
    context, 4 layers, a right-padded batch; its fix (the right context on the first layer only) is quiet."""
    name = "mha_chunk_right_context_every_layer_padded"
    status, found, report = traced(tmp_path, name, False, CHUNKAHEAD)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "chunk-lookahead-compounds"]
    first = min(k for k in reached(12, 3, [1] * 4, 12)[0] if k > 2 + 1)
    assert hit["severity"] == "wrong" and hit["cell"] == [0, 0, first], report
    status, found, report = traced(tmp_path, name, True, CHUNKAHEAD)
    assert status == 0 and not [f for f in found if f["severity"] == "wrong"], report
