"""The model call's stated padding over a call whose rows fold its batch with the heads (checks/real.resolve).

Eager attention written as BART's and its TF ports' (`view(bsz * num_heads, tgt_len, src_len)`), and torch's
nn.MultiheadAttention, lay a (B, L) batch's scores as (B * H, Lq, Lk), batch-major (row n is sample n // H). Where the
attending module states its H heads (details["stated_heads"]) and the layer it runs in was handed B rows
(details["query_input"]), the padding the model call states for those B rows is each of the call's rows' (TF LED's
decoder, transformers#9601's fix, blind-kw: its left-padded decoder prefix's padded queries, lowered everywhere by the
causal and padding biases summed, were read as real queries that see later keys).
"""

from __future__ import annotations

import numpy as np


def folded(call, top, rows: int, k_len: int, stated) -> tuple | None:
    """`stated` (checks/real.stated) of the layer's B rows laid batch-major over the call's B * H rows, where the
    attending module states H heads and the call has no heads axis of its own; None elsewhere."""
    heads, given = call.details.get("stated_heads"), call.details.get("query_input")
    if not isinstance(heads, int) or heads < 2 or not given or int(given[0]) * heads != rows or call.shape[1] != 1:
        return None
    batch = int(given[0])
    said = stated(top, batch, k_len)
    return None if said is None else (np.repeat(np.broadcast_to(said[0], (batch, k_len)), heads, axis=0), *said[1:])
