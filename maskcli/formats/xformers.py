"""xformers memory_efficient_attention: an attention-bias object instead of a mask tensor.

Documented classes (xformers.ops.fmha.attn_bias): LowerTriangularMask (query i sees keys
j <= i, top-left), LowerTriangularFromBottomRightMask (j <= i + Lk - Lq),
LowerTriangularFromBottomRightLocalAttentionMask(window_size) (and i + Lk - Lq - window_size
< j), LocalAttentionFromBottomRightMask(window_left, window_right); for packed sequences
BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen) (full inside each block),
BlockDiagonalCausalMask (causal inside each block, aligned top-left: "a query cannot attend
a key farther from the block's first key than it is from the block's first query"),
BlockDiagonalCausalFromBottomRightMask, and BlockDiagonalCausalLocalAttentionMask(window_size)
/ ...FromBottomRightMask. window_size counts keys with the query's own: an HF window W is
window_size=W (FlashAttention's left is W-1).
"""

from __future__ import annotations

from maskcli.formats.base import CannotHold, Export
from maskcli.formats.segments import sequences

NAME = "xformers"
INLINE = 32  # seqlens lists longer than this are read from the saved file


def to(mask) -> Export:
    found = sequences(mask, "xformers")
    left, right = found.left, found.right
    tensors = {}
    notes = []
    if found.batch.size == 1 and found.dropped_rows == 0:
        if (left, right) == (-1, -1):
            bias = "None"
        elif right == 0 and left == -1:
            bias = "LowerTriangularMask()" if found.square else "LowerTriangularFromBottomRightMask()"
        elif right == 0:
            bias = f"LowerTriangularFromBottomRightLocalAttentionMask(window_size={left + 1})"
        elif left >= 0 and right >= 0:
            bias = f"LocalAttentionFromBottomRightMask(window_left={left}, window_right={right})"
        else:
            raise CannotHold(f"xformers has no bias for {mask.title} (keys after the diagonal with no left window): use --for flash-attn or sdpa")
        shape = "(B, L, H, D)"
    else:
        if right not in (0, -1) or (right == -1 and left != -1):
            raise CannotHold(f"xformers' block-diagonal biases have no window past the diagonal, which {mask.title} needs: use --for flash-attn")
        square = found.square
        if (left, right) == (-1, -1):
            name, extra = "BlockDiagonalMask", ""
        elif left == -1:
            name, extra = "BlockDiagonalCausalMask" if square else "BlockDiagonalCausalFromBottomRightMask", ""
        else:
            name = "BlockDiagonalCausalLocalAttentionMask" if square else "BlockDiagonalCausalLocalAttentionFromBottomRightMask"
            extra = f", window_size={left + 1}"
        q_lens, k_lens = found.q_lens.tolist(), found.k_lens.tolist()
        if len(q_lens) <= INLINE:
            args = f"{q_lens}, {k_lens}" if not square else f"{q_lens}"
        else:
            tensors = {"q_seqlen": found.q_lens, "kv_seqlen": found.k_lens}
            args = "<q_seqlen>.tolist(), <kv_seqlen>.tolist()"
        bias = f"{name}.from_seqlens({args}{extra})"
        shape = "(1, total_tokens, H, D), the sequences packed one after another"
        if found.dropped_rows:
            notes.append(f"{found.dropped_rows} padding query rows are left out: pack only the real tokens")
    names = bias.split("(")[0].split(".")[0]
    code = ["import xformers.ops as xops"]
    if bias != "None":
        code.append(f"from xformers.ops.fmha.attn_bias import {names}")
    code.append(f"out = xops.memory_efficient_attention(q, k, v, attn_bias={bias})  # q, k, v: {shape}")
    if left >= 0 and right == 0:
        notes.append(f"window_size counts the query's own key: a window of W keys is window_size=W; here {left + 1}")
    return Export(code, tensors, notes)
