"""xformers memory_efficient_attention: an attention-bias object instead of a mask tensor.

Written for xformers 0.0.35 (xformers/ops/fmha/attn_bias.py of its wheel; from later commits the same classes
come from mslk.attention.fmha.attn_bias). Its classes and how each is made:
LowerTriangularMask() (query i sees keys j <= i, top-left); LowerTriangularFromBottomRightMask()
(j <= i + Lk - Lq) and its .make_local_attention(window_size) (also i + Lk - Lq - window_size < j; the
class it returns keeps the size in a field `_window_size`, so it is made by that method, not by a keyword);
LocalAttentionFromBottomRightMask(window_left=, window_right=). For packed sequences
BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen=None) (full inside each block), BlockDiagonalCausalMask
(causal inside each block, top-left) and BlockDiagonalCausalFromBottomRightMask (bottom-right, each block
needs keys >= queries); a window comes from a block-diagonal bias's .make_local_attention(window_size)
(top-left) or .make_local_attention_from_bottomright(window_size): from_seqlens takes no window keyword.
window_size counts keys with the query's own: an HF window W is window_size=W (FlashAttention's left is W-1).
"""

from __future__ import annotations

import numpy as np

from maskcli.formats.base import CannotHold, Export, plain_rows
from maskcli.formats.segments import NO_LIMIT, left_out, sequences

NAME = "xformers"
VERSION = "xformers 0.0.35"
INLINE = 32  # seqlens lists longer than this are read from the saved file
PACKED = "q, k, v: (1, total_tokens, H, D), the sequences packed one after another"
BATCHED = "q: (B, Lq, H, D), k and v: (B, Lk, H, D)"


def to(mask) -> Export:
    try:
        found = sequences(mask, "xformers")
    except CannotHold as why:
        top_left = _top_left(mask)
        if top_left is None:
            raise why from None
        return top_left
    left, right = found.left, found.right
    if right == NO_LIMIT and left != NO_LIMIT and bool(np.all(found.q_lens == 1)):
        right = 0  # one query per sequence, on the last key: no key lies past its diagonal, so this is causal
    f = mask.frame
    whole = (found.batch.size == 1 and found.dropped_rows == 0 and (int(found.q_lo[0]), int(found.q_hi[0])) == (f.q_start, f.q_end)
             and (int(found.k_lo[0]), int(found.k_hi[0])) == (f.k_start, f.k_end))
    if whole:
        return _single(mask, left, right, found.square)
    return _packed(mask, found, left, right)


def _single(mask, left: int, right: int, square: bool) -> Export:
    """One sequence over the whole frame: a bias that needs no lengths, for q, k, v of (B, L, H, D)."""
    f = mask.frame
    notes = []
    if (left, right) == (NO_LIMIT, NO_LIMIT):
        return _export(None, "None", BATCHED, notes)
    if right == 0 and left == NO_LIMIT:
        name = "LowerTriangularMask" if square else "LowerTriangularFromBottomRightMask"
        return _export(name, f"{name}()", BATCHED, notes)
    if right == 0:
        notes.append(_window_note(left + 1))
        return _export("LowerTriangularFromBottomRightMask", f"LowerTriangularFromBottomRightMask().make_local_attention({left + 1})",
                       BATCHED, notes)
    no_limit = max(f.q_len, f.k_len)  # a side without a limit: a window wider than the keys at this length
    if NO_LIMIT in (left, right):
        notes.append(f"window {'left' if left == NO_LIMIT else 'right'}={no_limit} reaches past every key at this length: no limit on that side")
    window_left, window_right = (no_limit if x == NO_LIMIT else x for x in (left, right))
    return _export("LocalAttentionFromBottomRightMask",
                   f"LocalAttentionFromBottomRightMask(window_left={window_left}, window_right={window_right})", BATCHED, notes)


def _packed(mask, found, left: int, right: int) -> Export:
    """Sequences packed one after another (documents, or each batch row's real tokens): a block-diagonal bias."""
    if right not in (0, NO_LIMIT) or (right == NO_LIMIT and left != NO_LIMIT):
        raise CannotHold(f"xformers' block-diagonal biases have no window past the diagonal, which {mask.title} needs: use --for flash-attn")
    square = found.square
    if not square and right == 0 and bool(np.any(found.k_lens < found.q_lens)):
        raise CannotHold(f"xformers' BlockDiagonalCausalFromBottomRightMask needs at least as many keys as queries in each sequence, "
                         f"and {mask.title} has fewer: use --for flash-attn")
    tensors = {}
    q_lens, k_lens = found.q_lens.tolist(), found.k_lens.tolist()
    if len(q_lens) <= INLINE:
        args = f"{q_lens}" if square else f"{q_lens}, {k_lens}"
    else:
        tensors = {"q_seqlen": found.q_lens, "kv_seqlen": found.k_lens}
        args = "<q_seqlen>.tolist(), <kv_seqlen>.tolist()"
    notes = []
    if (left, right) == (NO_LIMIT, NO_LIMIT):
        name, method = "BlockDiagonalMask", ""
    else:
        name = "BlockDiagonalCausalMask" if square else "BlockDiagonalCausalFromBottomRightMask"
        method = "" if left == NO_LIMIT else f".make_local_attention{'' if square else '_from_bottomright'}({left + 1})"
        if left != NO_LIMIT:
            notes.append(_window_note(left + 1))
    return _export(name, f"{name}.from_seqlens({args}){method}", PACKED, notes + left_out(found, mask), tensors)


def _top_left(mask) -> Export | None:
    """Causal or a causal window aligned top-left (query i on key i) where queries and keys differ in number:
    LowerTriangularMask, or a one-block BlockDiagonalMask made local top-left; None for any other mask."""
    f = mask.frame
    if f.padded or mask.batch != 1:
        return None
    try:
        starts, ends = plain_rows(mask, "xformers")
    except CannotHold:
        return None
    if starts.shape[2] != 1:
        return None
    s, e = starts[0, :, 0] - f.k_start, ends[0, :, 0] - f.k_start
    i = np.arange(f.q_len)
    if not np.array_equal(e, np.minimum(i + 1, f.k_len)):
        return None
    windows = np.unique((i + 1 - s)[s > 0])
    if windows.size == 0 and np.all(s == 0):
        return _export("LowerTriangularMask", "LowerTriangularMask()", BATCHED,
                       ["LowerTriangularMask is top-left aligned (query i sees keys j <= i), as this mask is"])
    if windows.size != 1 or not np.array_equal(s, np.maximum(0, i + 1 - int(windows[0]))) or f.q_len - int(windows[0]) >= f.k_len:
        return None
    window = int(windows[0])
    return _export("BlockDiagonalMask", f"BlockDiagonalMask.from_seqlens([{f.q_len}], [{f.k_len}]).make_local_attention({window})",
                   PACKED, ["make_local_attention is top-left aligned (query i sees keys i - window_size < j <= i), as this mask is",
                            _window_note(window)])


def _window_note(window: int) -> str:
    return f"window_size counts the query's own key: a window of W keys is window_size=W; here {window}"


def _export(name: str | None, bias: str, shape: str, notes: list[str], tensors: dict | None = None) -> Export:
    code = ["import xformers.ops as xops"]
    if name is not None:
        code.append(f"from xformers.ops.fmha.attn_bias import {name}")
    code.append(f"out = xops.memory_efficient_attention(q, k, v, attn_bias={bias})  # {shape}")
    return Export(code, tensors or {}, notes)
