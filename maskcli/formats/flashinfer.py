"""FlashInfer's ragged prefill: qo_indptr / kv_indptr with causal and window_left, or a bit-packed custom mask.

Documented rule (flashinfer BatchPrefillWithRaggedKVCacheWrapper.plan): qo_indptr and
kv_indptr cut the packed queries and keys into requests, as cu_seqlens do; `causal` aligns
the last query with the last key (bottom-right); `window_left` keeps keys j >= i + kv_len -
qo_len - window_left, -1 for no window (so a window of W keys is window_left=W-1). A mask
that is not such a band goes as `custom_mask`: per request the (qo_len, kv_len) keep matrix
(True = attend), flattened and concatenated, which plan() packs with
flashinfer.packbits(custom_mask, bitorder="little"); `packed_custom_mask` is that packing
(bit i of byte n is element 8n+i) with `qk_indptr` the bit offsets per request. The
custom mask is O(sum of qo_len x kv_len): one request per batch row.
"""

from __future__ import annotations

import numpy as np

from maskcli.formats.base import CannotHold, Export, heads_differ
from maskcli.formats.flash_attn import cu_seqlens
from maskcli.formats.segments import ELSEWHERE, left_out, sequences
from maskcli.memory import check_dense_fits

NAME = "flashinfer"


def to(mask) -> Export:
    try:
        found = sequences(mask, "flashinfer")
    except CannotHold as why:
        return _custom(mask, str(why))
    if found.right not in (0, -1):
        return _custom(mask, f"keys after the diagonal ({found.right}) are no window_left")
    tensors = {"qo_indptr": cu_seqlens(found.q_lens), "kv_indptr": cu_seqlens(found.k_lens)}
    code = _plan(f"causal={found.causal}, window_left={found.left}")
    notes = [f"window_left counts keys before the diagonal: a window of W keys is W-1; here {found.left}"] + left_out(found, mask)
    return Export(code, tensors, notes)


def _plan(args: str) -> list[str]:
    return [
        "import flashinfer",
        "wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=\"cuda\"), \"NHD\")",
        f"wrapper.plan(<qo_indptr>, <kv_indptr>, num_qo_heads, num_kv_heads, head_dim, {args})",
        "out = wrapper.run(q, k, v)  # q: (total_q, num_qo_heads, head_dim), k and v: (total_kv, num_kv_heads, head_dim)",
    ]


def _custom(mask, why: str) -> Export:
    """One request per batch row: its (Lq, Lk) keep matrix flattened (custom_mask), and packed as
    flashinfer.segment_packbits packs it (each request's bits little-endian, padded to whole bytes)."""
    if heads_differ(mask):
        raise CannotHold("flashinfer's custom mask is one for every head, and this mask's heads differ: use --for sdpa")
    f = mask.frame
    check_dense_fits((mask.batch, f.q_len, f.k_len), 1 + 1 / 8, "as FlashInfer's custom mask", what="the custom mask of")
    flat = [mask.cells(b).ravel() for b in range(mask.batch)]
    packed = [np.packbits(cells, bitorder="little") for cells in flat]
    tensors = {
        "qo_indptr": cu_seqlens(np.full(mask.batch, f.q_len)), "kv_indptr": cu_seqlens(np.full(mask.batch, f.k_len)),
        "custom_mask": np.concatenate(flat), "packed_custom_mask": np.concatenate(packed),
        "packed_mask_indptr": cu_seqlens(np.array([p.size for p in packed])),
    }
    code = _plan("custom_mask=<custom_mask>")
    reason = why.split(": ", 1)[-1].removesuffix(": " + ELSEWHERE)
    notes = [f"no causal/window_left band holds it ({reason}): a custom mask, True = attend, "
             f"which plan() bit-packs to {tensors['packed_custom_mask'].size:,} bytes (saved as packed_custom_mask)",
             "packing is little-endian: bit i of byte n is cell 8n+i of a request's flattened (qo_len, kv_len) keep matrix"]
    return Export(code, tensors, notes)
