"""A key padding mask that calls padding the very tokens the call queries: a keep mask handed where True = padding.

nn.MultiheadAttention's `key_padding_mask` (True = ignore the key) is the program's word on which keys of each batch
row are padding. Where the call's queries are its own keys (trace/masks.py's kv_source "query": one projection of
one input), the queries are tokens of that sequence, and where they are a slice of it (`attention(query=x[:, T:],
key=x, value=x)`: the decoder queries the forecast steps, details `query_offset`) they sit at known key positions.
The call computes those queries' outputs, so they are real. A key padding mask that calls padding every query's own
key in every batch row, while it calls some key real, names real the rest (the missing values, the pads) and padding
the data: it is the wrong way round (awslabs/gluonts 8e2e909: TFT's decoder handed `past_observed_values` (1 =
observed) straight as key_padding_mask, so the forecast steps attended only the missing past steps; the fix passes
`1 - observed`). Quiet: a mask under which some query's own key is real in some row (a padded batch's pad rows beside
real ones), a mask that calls every key padding, and keys of another sequence or a cache (no position known).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.keypadding import valid
from maskcli.text import Finding, spans


def queries_called_padding(run: Run) -> list:
    """Calls whose key padding argument calls padding every query's own key, in every batch row, and real some key."""
    found, done = [], set()
    for call in run.calls:
        details = call.details
        given = details.get("key_padding")
        batch, _, q_len, k_len = call.shape
        if not given or details.get("kv_source") != "query" or q_len > k_len:
            continue
        start = 0 if q_len == k_len else details.get("query_offset")
        if not isinstance(start, int) or (str(given), call.shape, start) in done:
            continue
        done.add((str(given), call.shape, start))
        real = valid(given, batch, k_len)
        own = np.arange(start, start + q_len)
        if real[:, own].any() or not real.any():
            continue
        b = int(np.argmax(real.any(axis=1)))
        kept = np.flatnonzero(real[b]).tolist()
        found.append((call, Finding("queries-called-padding", (
            f"{call.where}: its key_padding_mask (True = padding) calls padding the key{'s' if q_len > 1 else ''} "
            f"{spans(own.tolist())}, this call's own quer{'ies' if q_len > 1 else 'y'} (it computes their outputs), "
            f"in every batch row, and real only "
            f"{len(kept)} other key{'s' if len(kept) != 1 else ''} (batch row {b}: key{'s' if len(kept) != 1 else ''} "
            f"{spans(kept)} of {k_len}): the "
            f"mask is the wrong way round (a keep or observed mask, 1 = real, handed where True = padding is read: "
            f"`~mask` or `1 - mask` meant?)"),
            expected="its complement", source="the call's own queries", cell=(b, 0, int(own[0])))))
    return found


RULES = (
    Rule("queries-called-padding", "wrong", "call", "a key padding mask that calls padding the call's own queries in "
         "every batch row, and real some other key (a keep mask, 1 = observed, handed where True = padding)",
         queries_called_padding),
)
