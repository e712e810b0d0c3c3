"""For your own test suite: `assert_mask(mask_or_call, "window(4096)")` fails naming the first cells that differ.

    with maskcli.trace() as t:
        model(input_ids)
    assert_mask(t.calls[0], "causal & window(4096)")          # queries placed at the end of the keys
    assert_mask(keep_tensor, "causal", lengths="4,2")          # MaskOptions fields place and pad the expression

The padding is found by one rule, the one `maskcli trace --expect` and trace's names use (maskcli.keypadding):
lengths= or ids= where given; else the call's own key-padding argument (nn.MultiheadAttention's
key_padding_mask); else the keys that no query of a batch row sees while a query of another row does. To say
there is none, give full lengths (lengths="6,6").
"""

from __future__ import annotations

import numpy as np

from maskcli.diff import Difference, compare, row_words
from maskcli.errors import MaskError
from maskcli.mask import Mask, MaskOptions, build, from_tensor


def keep_array(mask_or_call) -> np.ndarray:
    """Bool (B, H, Lq, Lk), True = may attend, from a traced call, a Mask, or a bool keep tensor/array of 2 to 4 dimensions."""
    if hasattr(mask_or_call, "keep") and callable(mask_or_call.keep):
        keep = np.asarray(mask_or_call.keep())
        for dim in (0, 1):  # batch rows or heads that repeat (a broadcast view) are compared once
            if keep.shape[dim] > 1 and keep.strides[dim] == 0:
                keep = keep[:1] if dim == 0 else keep[:, :1]
        return keep
    if isinstance(mask_or_call, Mask):
        return mask_or_call.dense()
    array = np.asarray(mask_or_call.detach().cpu() if hasattr(mask_or_call, "detach") else mask_or_call)
    if array.dtype != bool:
        raise MaskError(f"assert_mask takes a bool keep mask (True = may attend), a traced call or a Mask; got dtype {array.dtype}")
    if not 2 <= array.ndim <= 4:
        raise MaskError(f"a mask has 2 to 4 dimensions (Lq, Lk) .. (B, H, Lq, Lk); got shape {list(array.shape)}")
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


def against(keep: np.ndarray, expression: str, label: str = "the mask", **positions) -> Difference:
    """`keep` (B, H, Lq, Lk) compared with `expression` placed at its positions: the queries at the end of the keys
    unless `positions` (MaskOptions fields: offset, kv_start, lengths, ids, ...) say otherwise."""
    expected = _placed(keep.shape, expression, label, positions)
    captured = from_tensor(np.ascontiguousarray(keep), label, expected.frame.q_start, expected.frame.k_start)
    return compare(captured, expected)


def expected_cells(shape: tuple, expression: str, **positions) -> np.ndarray:
    """Bool cells of `expression` placed as `against` places it for a mask of `shape` (B, H, Lq, Lk); its batch rows
    and heads may be 1 (they broadcast)."""
    return _placed(shape, expression, "the mask", positions).dense()


def _placed(shape: tuple, expression: str, label: str, positions: dict) -> Mask:
    batch, heads, q_len, k_len = shape
    positions = dict(positions)
    if q_len > k_len and "offset" not in positions:
        raise MaskError(f"{label} has more queries ({q_len}) than keys ({k_len}): give offset= to place them")
    offset = positions.pop("offset", k_len - q_len)
    options = MaskOptions(**{"length": q_len, "offset": offset or None, "heads": heads,
                             "kv_len": None if offset + q_len == k_len else k_len, **positions})
    return build(expression, options)


def padding(keep: np.ndarray, mask_or_call, positions: dict) -> dict:
    """The key padding to place the expression with, by maskcli.keypadding's rule: {} where `positions` give it."""
    from maskcli.keypadding import of

    details = getattr(mask_or_call, "details", None)
    given = details.get("key_padding") if isinstance(details, dict) else None
    return of(keep, given, positions)


def assert_mask(mask_or_call, expression: str, **positions) -> None:
    """Raise AssertionError naming the first rows and keys where the mask and the expression differ."""
    keep = keep_array(mask_or_call)
    found = padding(keep, mask_or_call, positions)
    difference = against(keep, expression, **found, **positions)
    if not difference.equal:
        lines = row_words(difference, "the mask", expression)
        pad = f" with the padding found ({', '.join(f'{k}={v!r}' for k, v in found.items())})" if found else ""
        raise AssertionError(
            f"the mask is not {expression}{pad}: {difference.only_a} cells only the mask allows, {difference.only_b} only "
            f"{expression} allows; " + "; ".join(lines)
        )
