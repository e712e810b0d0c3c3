"""FlashInfer's plan() arguments (flashinfer/prefill.py BatchPrefillWithPagedKVCacheWrapper.plan, decode.py).

qo_indptr (R+1); paged_kv_indptr (R+1) over paged_kv_indices, the pages of each request in
order; paged_kv_last_page_len (R): tokens in its last page, 1..page_size, so its keys are
(pages - 1) * page_size + last; the kv_* spellings too. Without kv_indices, kv_indptr cuts a
ragged (unpaged) KV. causal aligns bottom-right; window_left keeps keys j >= i + kv_len -
qo_len - window_left (W keys is W-1; -1 none). custom_mask: flattened (qo_len, kv_len) bool per
request; packed_custom_mask: the same bits packed little-endian per request (segment_packbits),
at mask_indptr bytes (or packed_mask_indptr, as `maskcli export --for flashinfer` writes it).
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.serve.batch import ServeBatch, cumulative
from maskcli.serve.fields import Fields
from maskcli.serve.trees import unpack_bytes

NAME = "flashinfer"
TITLE = "FlashInfer plan() arguments"
MARKS = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "kv_indptr", "kv_indices", "kv_last_page_len",
         "window_left", "packed_custom_mask", "packed_mask_indptr")
READS = MARKS + ("page_size", "causal", "custom_mask", "mask_indptr")


def load(f: Fields) -> ServeBatch:
    kv_indptr = f.indptr("paged_kv_indptr", "kv_indptr")
    q_indptr = f.indptr("qo_indptr", required=False)
    notes = ()
    if q_indptr is None:  # BatchDecodeWithPagedKVCacheWrapper.plan takes no qo_indptr: one query per request
        q_indptr = np.arange(len(kv_indptr), dtype=np.int64)
        notes = ("no qo_indptr: read as a decode plan, one query per request",)
    requests = len(q_indptr) - 1
    if len(kv_indptr) != requests + 1:
        raise MaskError(f"{f.source!r}: {f.key('paged_kv_indptr', 'kv_indptr')} has {len(kv_indptr)} entries and qo_indptr "
                        f"{requests + 1}; both have one per request plus 1")
    names = {"queries": "qo_indptr", "seq_lens": "kv_len", "table": f.key("paged_kv_indices", "kv_indices") or "kv_indices",
             "last": f.key("paged_kv_last_page_len", "kv_last_page_len") or "kv_last_page_len", "window": "window_left"}
    indices = f.vector("paged_kv_indices", "kv_indices")
    last = f.vector("paged_kv_last_page_len", "kv_last_page_len")
    if indices is None and last is None:  # ragged KV: kv_indptr counts tokens
        seq_lens, page_size, pages, last_fill = np.diff(kv_indptr), 0, np.zeros(0, np.int64), None
        kv_indptr = np.zeros(requests + 1, np.int64)
    else:
        if indices is None or last is None:
            raise MaskError(f"{f.source!r}: a paged KV needs both kv_indices and kv_last_page_len beside kv_indptr")
        page_size = f.page_size("page_size")
        last_fill = f.per_request(last, requests, names["last"])
        counts = np.diff(kv_indptr)
        seq_lens = np.where(counts > 0, (counts - 1) * page_size + last_fill, 0)
        if kv_indptr[-1] > indices.size:
            raise MaskError(f"{f.source!r}: kv_indptr ends at {int(kv_indptr[-1])} but kv_indices holds {indices.size} pages")
        pages = indices[: int(kv_indptr[-1])]
    window, said = f.limit("window_left")
    notes += said
    causal = f.flag("causal", default=False)
    if window is not None and window >= 0 and not causal:
        raise MaskError(f"{f.source!r}: window_left {window} without causal reaches keys after the query; serve reads windows "
                        f"of causal layers (causal=True)")
    return ServeBatch(NAME, q_indptr, seq_lens, page_size, kv_indptr, pages, names, causal=causal, last_fill=last_fill,
                      window=None if window is None or window < 0 else window + 1, trees=_trees(f, np.diff(q_indptr), seq_lens),
                      notes=notes)


def _trees(f: Fields, q_lens: np.ndarray, seq_lens: np.ndarray) -> dict[int, np.ndarray]:
    sizes = q_lens * seq_lens
    if f.has("custom_mask"):
        flat = np.asarray(f.raw("custom_mask")).ravel().astype(bool)
        indptr = cumulative(sizes)
        if flat.size < indptr[-1]:
            raise MaskError(f"{f.source!r}: custom_mask holds {flat.size} cells; the requests' (qo_len x kv_len) masks need {int(indptr[-1])}")
        cells = [flat[indptr[r]:indptr[r + 1]] for r in range(len(sizes))]
    elif f.has("packed_custom_mask"):
        bytes_ = f.indptr("mask_indptr", "packed_mask_indptr", required=False)
        bytes_ = cumulative(-(-sizes // 8)) if bytes_ is None else bytes_
        cells = unpack_bytes(np.asarray(f.raw("packed_custom_mask")).ravel(), bytes_, sizes, f"{f.source!r}: packed_custom_mask")
    else:
        return {}
    return {r: c.reshape(q_lens[r], seq_lens[r]) for r, c in enumerate(cells) if c.size}
