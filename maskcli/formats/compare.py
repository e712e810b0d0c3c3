"""What a mask costs in each format at its length: bytes, and whether the format holds it exactly.

Dense sizes are arithmetic (nothing is allocated); the O(L) formats are built from the
intervals, which is how we learn whether they hold the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

from maskcli.blockmask import DEFAULT_BLOCK
from maskcli.formats.base import CannotHold
from maskcli.mask import Mask


@dataclass(frozen=True)
class Cost:
    format: str
    bytes: int | None  # None where the format cannot hold the mask
    exact: str  # "yes", or why not / what else it needs


def costs(mask: Mask) -> list[Cost]:
    from maskcli.formats import flashmask, magi, segments

    batch, _, q_len, k_len = mask.shape
    heads = mask.heads if mask.heads_differ else 1
    cells = batch * heads * q_len * k_len
    rows = [
        Cost("dense bool (sdpa, mha)", cells, "yes"),
        Cost("additive float32 (hf)", 4 * cells, "yes"),
        Cost("additive bfloat16", 2 * cells, "yes"),
        _blocks(mask, batch * heads),
    ]

    def attempt(name: str, make):
        try:
            size = make()
        except CannotHold as why:
            return Cost(name, None, "no: " + str(why).split(": ", 1)[-1])
        return Cost(name, size, "yes")

    def seqlens():
        found = segments.sequences(mask, "flash-attn varlen")
        return 2 * 4 * (found.batch.size + 1)

    rows.append(attempt("cu_seqlens (flash-attn, flashinfer, xformers)", seqlens))
    rows.append(attempt("FlashMask startend_row_indices", lambda: flashmask.bounds(mask)[0].nbytes))
    rows.append(attempt("MagiAttention ranges", lambda: sum(a.nbytes for a in magi.slices(mask))))
    return rows


def _blocks(mask: Mask, planes: int) -> Cost:
    f = mask.frame
    n_q, n_kv = -(-f.q_len // DEFAULT_BLOCK), -(-f.k_len // DEFAULT_BLOCK)
    size = 4 * planes * n_q * (2 + 2 * n_kv)
    name = f"BlockMask at {DEFAULT_BLOCK}"
    if not mask.exact:
        return Cost(name, size, "with its mask_mod")
    touched, full = mask.intervals().block_sets(f.q_len, DEFAULT_BLOCK, DEFAULT_BLOCK)
    partial = int((touched & ~full).counts().sum())
    return Cost(name, size, "yes" if partial == 0 else f"with its mask_mod ({partial:,} partial blocks)")
