"""Key padding: which keys of each batch row are padding, as the flags that say it (--lengths, --pad left, --ids).

One rule, for trace's names, --expect and maskcli.testing.assert_mask alike (`of`):

1. padding the caller states (lengths=, ids=) is the padding;
2. else the call's own key-padding argument, where its API has one (nn.MultiheadAttention's key_padding_mask;
   SDPA, flex and a softmax have none): the keys it masks, and no others (`given`);
3. else it is read off the mask: per batch row, the keys that no query of that row sees while a query of another
   row does (rows padded differently, as a batch is). One batch row, or rows that agree, have none.
"""

from __future__ import annotations

import numpy as np


def options(valid: np.ndarray) -> dict:
    """MaskOptions fields for (B, Lk) real keys: --lengths where each row's real keys are a prefix, --lengths with
    --pad left where each is a suffix, else --ids (1 = a real key, 0 = padding, --pad-id 0)."""
    valid = np.asarray(valid, dtype=bool)
    lengths = valid.sum(axis=1)
    columns = np.arange(valid.shape[1])[None, :]
    text = ",".join(map(str, lengths.tolist()))
    if np.array_equal(columns < lengths[:, None], valid):
        return {"lengths": text}
    if np.array_equal(columns >= valid.shape[1] - lengths[:, None], valid):
        return {"lengths": text, "pad": "left"}
    return {"ids": ";".join(",".join("1" if v else "0" for v in row) for row in valid.tolist()), "pad_id": 0}


def valid(found: dict, batch: int, k_len: int) -> np.ndarray:
    """Bool (B, Lk) real keys from options(...)'s fields (a row the fields do not give is all real)."""
    if "ids" in found:
        rows = np.array([[int(x) != found.get("pad_id", 0) for x in row.split(",")] for row in found["ids"].split(";")], bool)
    elif "lengths" in found:
        lengths = np.array([int(x) for x in found["lengths"].split(",")])[:, None]
        columns = np.arange(k_len)[None, :]
        rows = columns >= k_len - lengths if found.get("pad") == "left" else columns < lengths
    else:
        rows = np.ones((1, k_len), bool)
    return np.broadcast_to(rows, (batch, k_len)) if rows.shape[0] == 1 else rows


def read(keep: np.ndarray) -> dict:
    """Padding read off a (B, H, Lq, Lk) keep mask (rule 3): {} where no batch row's keys differ so."""
    seen = keep.any(axis=(1, 2))  # (B, Lk)
    if seen.shape[0] < 2:
        return {}
    padded = ~seen & seen.any(axis=0, keepdims=True)
    return options(~padded) if padded.any() else {}


def of(keep: np.ndarray, given: dict | None = None, stated: dict | None = None) -> dict:
    """The padding by the rule above: `stated` fields (lengths, ids, pad, pad_id) where they say any, else the call's
    key-padding argument `given` ({} for none: its API has one and it was not passed), else read off the mask."""
    if stated and ("lengths" in stated or "ids" in stated):
        return {}  # (already in the caller's fields)
    if given is not None:
        return dict(given)
    return read(keep)
