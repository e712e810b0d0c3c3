"""A padding the program holds over a whole sequence, read over a call that folds that sequence into the batch in
chunks of its keys' length (a held (B, L) mask, a call of B * L / n batch rows over n keys: `x.reshape(-1, n, d)`).

Hourglass transformers' attention resampling (lucidrains/hourglass-transformer-pytorch 674ede1) pools each bucket of
`n` tokens into one and lets it attend to its bucket, the buckets folded into the batch, `(b m) n`: the padding mask
the model call holds, `mask` (B, L), read in those chunks (`mask.reshape(-1, n)`) says which keys of each chunk are
padding, and a chunk all of padding is a padding chunk, whose query stands for padding too. Read only over a memory the
attention layer was handed by name (`context`: checks/context.crossing), where the chunks are exact (L a multiple of n,
as many batch rows as chunks) and the held mask is a padded batch (each row one run of real tokens at one edge, one row
whole: padded_batch, checks/held.py's reading of padding): a self-attention's batch folded with its heads is not
read so. Nor is a padding of as many rows as such a fold's (B * H) where the model call was handed B rows of ids over
exactly the call's keys (handed_batch): it is another batch's (MPNet's sentence run alone over 4 heads, beside the
batch's 4 lengths that main() holds).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import cross, crossing


def padded_batch(real: np.ndarray, right_only: bool) -> bool:
    """Each row a run of real tokens at one edge, each with one, one row all real and one not."""
    count = real.sum(axis=1)
    if real.shape[0] < 2 or count.min() < 1 or count.max() != real.shape[1] or count.min() == real.shape[1]:
        return False
    at = np.arange(real.shape[1])[None, :]
    right = (real == (at < count[:, None])).all(axis=1)
    left = (real == (at >= real.shape[1] - count[:, None])).all(axis=1)
    return bool(right.all() or not right_only and (left.all() or (right | left).all()))


def image_padding(real: np.ndarray) -> bool:
    """Each row the real pixels of an image padded on the bottom and the right to the batch's largest height and width,
    flattened ((B, H, W) -> (B, H * W): DETR's `NestedTensor` mask, `mask.flatten(1)`): for some width W, each row a
    top-left rectangle of the (H, W) grid, some row padded, some row as wide as W and some as tall as H."""
    rows, length = real.shape
    for width in range(2, length // 2 + 1):
        if length % width:
            continue
        grid = real.reshape(rows, length // width, width)
        tall, wide = grid[:, :, 0].sum(axis=1), grid[:, 0, :].sum(axis=1)
        made = (np.arange(length // width)[None, :, None] < tall[:, None, None]) \
            & (np.arange(width)[None, None, :] < wide[:, None, None])
        if (grid == made).all() and tall.min() > 0 and wide.min() > 0 and not real.all() \
                and tall.max() == length // width and wide.max() == width:
            return True
    return False


def over_memory(call) -> bool:
    """A call whose keys are a memory its attention layer was handed by name (`context`, `memory`, a method's `kv`, or
    a `key` other than its `query`: ESPnet's `src_attn(x, memory, memory, mask)`; the one reading of cross-attention,
    checks/context.crossing, which holds the memory as long as the keys)."""
    reading = crossing(call)
    return reading.cross and reading.by in ("memory", "kv", "inputs")


def chunked(real: np.ndarray, rows: int, length: int) -> np.ndarray | None:
    """Bool (rows, length) real keys of `real` (B, L), the program's padding read as real (True = a real token), folded
    into chunks of `length` keys, one batch row each, sequence by sequence; None where the call is no such fold."""
    if real.ndim != 2 or length < 2 or real.shape[1] <= length or real.shape[1] % length \
            or real.shape[0] * real.shape[1] != rows * length:
        return None
    return real.reshape(rows, length)


def folded_padding(call, helds) -> list[tuple[dict, np.ndarray]]:
    """(held, real keys (rows, Lk)) of each held padding mask over a whole sequence, a padded batch, that `call`, over
    a memory its layer was handed, folds into chunks of its keys (chunked); [] on any other call."""
    if not over_memory(call):
        return []
    rows, length = call.shape[0], call.shape[3]
    found = []
    for held in helds or ():
        table = held.get("rows")
        if held.get("kind") not in ("keep", "pad") or not isinstance(table, np.ndarray) or table.ndim != 2:
            continue
        real = table if held["kind"] == "keep" else ~table
        if not padded_batch(real, held["name"] == "mask"):
            continue
        folded = chunked(real, rows, length)
        if folded is not None:
            found.append((held, folded))
    return found


def handed_batch(run, call) -> int | None:
    """The rows of ids over exactly these keys that the call's model call was handed, where the call folds them with
    more (B * m rows); None elsewhere."""
    from maskcli.checks.real import SOURCE, TOKENS, handed_ids

    top = run.top(call)
    ids = None if top is None else handed_ids(top.arguments, (*TOKENS, *SOURCE))
    if ids is None or ids[1].shape[1] != call.shape[3] or call.shape[0] <= ids[1].shape[0] \
            or call.shape[0] % ids[1].shape[0]:
        return None
    return ids[1].shape[0]


def rows_of(held: dict) -> int | None:
    """The batch rows a held padding covers."""
    found = held["rows"]
    return found.shape[0] if found.ndim >= 1 and held["kind"] in ("keep", "pad", "lengths", "relative") else None


def beyond_batch(run, call, held: dict) -> bool:
    """A held padding of another batch than the call's: its memory copied from another batch's rows (_copied_other),
    or more rows than the call's batch, where its first axis folds the batch with the heads its
    module states (fairseq's `bsz * num_heads` rows, one head axis of 1): the padding of a larger batch, not this
    call's (a sample run alone after the batch, 4 heads over 1 sample read as 4 samples by their count alone)."""
    if _copied_other(run, call, held):
        return True
    heads = call.details.get("own_heads") or call.details.get("stated_heads")
    rows, count = call.shape[0], rows_of(held)
    return isinstance(heads, int) and heads > 1 and call.shape[1] == 1 and rows % heads == 0 and count is not None \
        and count > rows // heads


def _copied_other(run, call, held: dict) -> bool:
    """A cross-attention whose memory's rows are copies of an earlier model call's output rows (checks/memrows.py) of
    another batch than the one a held padding covers: each row's padding is its source row's, so a padding of as many
    rows as this call's, held by a caller, is another batch's (a beam search over one sentence, its memory repeated per
    beam, while the training batch's lengths are held: tunz/transformer-pytorch's decoder.py)."""
    from maskcli.checks.memrows import copied_rows

    count = rows_of(held)
    if count is None or not cross(call):
        return False
    copied = copied_rows(run, call, call.shape[0], run.__dict__.setdefault("_copied_rows", {}))
    if not copied or any(one is None for one in copied) or len({id(one.top) for one in copied}) != 1:
        return False
    held_rows = copied[0].top.arguments.get("output_rows")
    sources = {len(hashes) for hashes in held_rows.values()} if isinstance(held_rows, dict) else set()
    return sources != {count} or [one.row for one in copied] != list(range(count))
