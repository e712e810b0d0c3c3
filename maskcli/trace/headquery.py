"""One query per head scored against its own keys by an einsum that holds no query axis: a paged decode written per
request, and the head counts a running module states.

A decode kernel ported to torch one request at a time (a FlashInfer- or vLLM-style paged decode: the request's keys
gathered out of the KV pool by its page indices, `k_buf[kv_indices[indptr[i]:indptr[i + 1]]]`, (n, H, D)) scores the
request's one query, (H, D), against them with an einsum whose output keeps the key axis and no axis of the query alone:
"hd,nhd->hn", "bhd,bnhd->bhn". No mask is handed to anything: which keys the kernel gathered is the mask (a sliding
decode wrapper gathers the window's keys, a full one every key of the request), and the softmax over those scores is
the attention call. Its scores are noted here (Scores.heads: id -> the einsum's own reading) and the softmax over them is
read as one query of H heads at the last of its keys, (1, H, 1, n) or (B, H, 1, n), as an SDPA call of one query is
read; the site's reading (crossing.py) says whether those keys are the request's own. Read so only where a running
module states X heads for the axis read as heads (`num_heads`, SGLang's `tp_q_head_num`, ...): else that axis may be
batch rows of one decoder state each against a memory, or each query's own gathered neighbours (ProteinMPNN's
"blh,blkh->blk"), which this reading does not take (no call is recorded of it).
"""

from __future__ import annotations

import torch

HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")  # a module's own head count
QUERY_HEADS = HEADS + ("heads", "tp_q_head_num", "num_q_heads")  # (an engine layer's query heads: SGLang's RadixAttention)


def _equation(args: tuple) -> tuple[str, str, str] | None:
    """(query letters, key letters, output letters) of a two-operand einsum with an explicit output, no ellipsis."""
    if len(args) != 3 or not isinstance(args[0], str) or "->" not in args[0] or "." in args[0]:
        return None
    given, out = args[0].replace(" ", "").split("->")
    parts = given.split(",")
    return (parts[0], parts[1], out) if len(parts) == 2 else None


def one_query(args: tuple, out) -> bool:
    """`out` of torch.einsum(*args) is one query's scores per lead cell: the output ends in a key axis only the second
    operand holds, every other output axis both operands hold (heads, a batch), the query holds no axis of its own
    and shares at least one contracted axis with the keys (its feature axis), and the keys are at least 3-D."""
    read = _equation(args)
    if read is None or not isinstance(out, torch.Tensor) or out.dim() not in (2, 3) or len(read[2]) != out.dim():
        return False
    query, key, letters = read
    q, k = args[1], args[2]
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or k.dim() < 3 or q.dim() != len(query) \
            or k.dim() != len(key) or len(set(query)) != len(query) or len(set(key)) != len(key):
        return False
    last = letters[-1]
    if last in query or last not in key or any(a not in query or a not in key for a in letters[:-1]):
        return False
    contracted = [a for a in query if a not in letters]  # (the features: the last axis of both, as q and k lay them
    return contracted == [query[-1]] and key[-1] == query[-1]  # out; weights by values, "hn,nhd->hd", contract no such)


def noted(scores, args: tuple, out) -> bool:
    """Note `out` as one query's scores per head (Scores.heads) where one_query says so; whether it did."""
    if not one_query(args, out):
        return False
    scores._note(out)
    scores.heads[id(out)] = out.dim()
    return True


def reader(softmax, scores, args: tuple, kwargs: dict, stack):
    """The reader of a softmax over one query's scores per head (Scores.heads): (X, n) read as (1, X, 1, n) and
    (B, X, n) as (B, X, 1, n) where a running module states X heads (`stack()`: the running modules, asked as the call
    is recorded; else no call); `softmax` itself for any other input."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if not isinstance(x, torch.Tensor) or id(x) not in scores.heads or not scores.has(x) or x.dim() not in (2, 3):
        return softmax
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim not in (-1, x.dim() - 1):
        return softmax

    def heads(args_, kwargs_):
        heads_axis = int(x.shape[0] if x.dim() == 2 else x.shape[1])
        if heads_axis > 1 and stated_heads(stack(), QUERY_HEADS) != heads_axis:
            return None  # (rows that may be a batch's, one decoder state each against a memory, or each query's own
            # gathered neighbours, ProteinMPNN's "blh,blkh->blk": not read here)
        seen = softmax(((x[None] if x.dim() == 2 else x)[:, :, None, :], -1), {})
        if seen is not None:
            seen.details["head_query"] = "one query per head scored by an einsum with no query axis, " \
                                         f"{tuple(int(n) for n in x.shape)} read as {tuple(seen.shape)}"
        return seen

    heads.api = "softmax"
    return heads


def banded(shape: tuple, stack: list) -> bool:
    """A 4-D softmax (over scores no q @ kᵀ made: the caller asks) whose third axis is its module's own head count and
    whose second is not: scores laid out (B, L, H, 2w + 1), each position's band of keys (Longformer's and LED's sliding
    chunks, modeling_led.py LEDEncoderSelfAttention), not a (B, H, Lq, Lk) matrix; read as one, positions were taken for
    heads and heads for queries. The innermost running module that states a head count decides."""
    if len(shape) != 4:
        return False
    heads = stated_heads(stack)
    return heads is not None and shape[2] == heads != shape[1]


def stated_heads(stack: list, names: tuple = HEADS) -> int | None:
    """The head count the innermost running module that states one holds (`names`), None where none does."""
    for module in reversed(stack):
        heads = next((value for value in map(lambda name: getattr(module, name, None), names)
                      if isinstance(value, int) and not isinstance(value, bool)), None)
        if heads is not None:
            return heads
    return None
