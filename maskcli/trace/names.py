"""A captured mask's name as it pastes back: the expression, then the `maskcli show` flags that place and pad it.

    causal                                   queries at the end of the keys, no padding
    causal (--lengths 5,2 --pad left)        left padding (right padding has no --pad)
    triu(1, means=keep) (--ids '1,1,1;1,0,0')   padding that is neither a prefix nor a suffix of each row
    causal (--kv-len 8)                      queries top-left: row i at key i (SDPA's is_causal with Lq < Lk)
    prefix(7) (--offset 4 --kv-len 8)        queries at key 4 of 8 (a static cache's slots after them)

What the call's shape says is not repeated: `--len` is its Lq, and the queries sit at the end of its Lk keys
(`--offset Lk-Lq`) unless the flags say --offset or --kv-len. So `maskcli show EXPR --len Lq [--offset Lk-Lq]
FLAGS` rebuilds the recorded mask cell for cell (tests/test_names.py runs every name a report prints).
"""

from __future__ import annotations

from maskcli.text import shell_quote

ORDER = ("length", "offset", "kv_start", "kv_len", "align", "lengths", "pad", "ids", "pad_id")  # (not heads: the shape's)


def flags(options: dict, q_len: int, k_len: int) -> str:
    """' (--lengths 5,2 --pad left)': the flags in MaskOptions fields `options` beyond what the shape says; '' for none."""
    from maskcli.inspect.structure import FLAGS

    at_end = k_len - q_len
    offset = options.get("offset", 0 if "kv_len" in options else at_end)
    placed_at_end = offset == at_end and options.get("kv_len", k_len) == k_len
    shown = []
    for key in ORDER:
        value = options.get(key)
        if value is None or (key == "length" and value == q_len) or (key == "pad_id" and value == 0):
            continue
        if key in ("offset", "kv_len") and (placed_at_end or (key == "offset" and value == 0)):
            continue
        shown.append(f"{FLAGS[key]} {shell_quote(str(value))}")
    return f" ({' '.join(shown)})" if shown else ""



PADDING = ("lengths", "pad", "ids", "pad_id")


def flipped_keep(keep, given: dict | None):
    """The mask read the other way round, (B, H, Lq, Lk): where the call's key-padding argument said which keys are
    padding (`given`, maskcli.keypadding fields), only its other mask is flipped; the padding stays padding."""
    if not given:
        return ~keep
    from maskcli.keypadding import valid

    return ~keep & valid(given, keep.shape[0], keep.shape[-1])[:, None, None, :]


def also_documents(structure, keep, q_len: int, k_len: int) -> str | None:
    """'document(sizes=[100,100,56])' where the recogniser named a square mask local(C) with no padding: documents of
    C tokens each (the last one shorter) are the same cells. Which one the program meant its structure says (a
    mask_mod reading a document tensor, or chunked attention), not its cells: both names are true, so a report says
    both (the documents rebuilt here and compared with the mask, cell for cell, before it is said)."""
    if structure.kind != "local" or q_len != k_len or set(structure.options) - {"length", "heads"}:
        return None
    import numpy as np

    from maskcli.errors import MaskError
    from maskcli.mask import MaskOptions, build

    size = structure.params.get("chunk_size")
    if structure.params.get("documents") is not None or not isinstance(size, int) or not 0 < size < k_len:
        return None
    sizes = [size] * (k_len // size) + ([k_len % size] if k_len % size else [])
    expression = f"document(sizes=[{','.join(map(str, sizes))}])"
    try:
        built = build(expression, MaskOptions(length=k_len)).dense()
    except MaskError:
        return None
    return expression if np.array_equal(np.broadcast_to(built[:, :1], keep[:, :1].shape), keep[:, :1]) else None
