"""A self-attention that hides each query's own token from it, while the query sees keys apart from its own.

Every mask a self-attention means keeps a token's own key: causal, windows, padding (for real tokens), prefixes,
chunks, documents, groups, draft trees. Where, in every batch row, each query that sees any key does not see its own
(the key at its position: the call's square diagonal, or its queries placed among the keys as placing.queries reads
them), and some query sees keys that its own would not join into one run, the mask is laid off the tokens: read the
other way round (Paddle3D#235: mmcv's bool `attn_mask`, True = blocked, handed to Paddle's MultiHeadAttention, which
reads True = attend, so DN-DETR's denoising groups see every group but their own), or its key positions shifted
(titans-pytorch 8902334: the MAC mask_mod took `kv_idx - is_persist_mem` for `kv_idx - persist_mem_len`, so each token
sees the tokens three places back and not itself). Quiet where the mask hides a query's own token on purpose and
nothing else marks it: each query's kept keys with its own are one run (a strictly causal mask, PixelSNAIL's first
block; leave-one-out attention, SAITS's diagonal masking, padded or not), the mask is symmetric (a graph's adjacency
without self-loops), or every query sees the same keys (a key mask alone, whatever its lengths), or some judged query
hides its own token alone, seeing the real keys beside it (a token taken out on purpose: RetroMAE's enhanced
decoder hides each position's own token and a sample of whole words; a mislaid mask hides a run around the token). Judged only where the
queries' places are known: as many queries as keys, positions the run states, or keys before the queries that every
attending query sees (a memory or sink prefix), or keys that end with the queries' own (a cache, a segment's memory);
never on cross-attention, nor where the cells read as hidden are hidden by other scores, not a mask (graphormer-pyg's
fix multiplying the scores by -1e6, which lifts the negative ones: trace/finitefill.py's `scores_hide`), and only over
own keys some query sees (a padding query's own key is hidden from all). Quiet behind a cache where every attending
query sees the key a fixed d before the position the run states for it: the positions count from d (OPT's learned
positions from pad + 1 over cache slots from 0), the mask keeps to the tokens.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, crossing, keep
from maskcli.checks.placing import queries, queries_stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def own_hidden(run: Run) -> list:
    """Self-attention calls whose attending queries never see their own key while seeing keys apart from it."""
    found, done = [], set()
    for call in run.calls:
        rows, _, q_len, k_len = call.shape
        if q_len < 3 or k_len < q_len or call.stored is None or call.mask in done:
            continue
        done.add(call.mask)
        if crossing(call).cross or call.details.get("scores_hide"):
            continue  # (cells hidden by other scores 1e4 and more above them, not by a mask: trace/finitefill.py)
        cells = keep(call)
        if cells is None:
            continue
        read = _read(call, run.top(call), cells.any(axis=1), crossing(call).by == "cache")
        if read is not None:
            found.append((call, read))
    return found


def _read(call, top, folded: np.ndarray, cached: bool) -> Finding | None:
    """The finding of one call's heads-folded (b, Lq, Lk) cells, or None. `cached`: its keys end with its queries'
    own (a cache, Transformer-XL's memory before the segment)."""
    q_len, k_len = folded.shape[1:]
    own = np.asarray(queries(call, top))
    if own.shape != (q_len,) or (own < 0).any() or (own >= k_len).any():
        return None
    attending = folded.any(axis=-1)
    if not attending.any() or (folded[:, np.arange(q_len), own] & attending).any():
        return None
    if (folded == folded[:, :1]).all() or q_len == k_len and (folded == folded.transpose(0, 2, 1)).all():
        return None  # (a key mask alone; a graph's adjacency without self-loops)
    if k_len > q_len and not cached and not queries_stated(call, top):
        ahead = folded[:, :, :k_len - q_len]  # (keys before the queries: placed there only where every attending
        if not (ahead.all(axis=-1) | ~attending).all():  # query sees them, a memory or sink prefix)
            return None
    if q_len < k_len and _numbered_from(folded, own, attending):
        return None  # (the positions stated number the tokens from elsewhere: OPT's and fairseq's from pad + 1)
    with_own = folded.copy()
    with_own[:, np.arange(q_len), own] = True
    starts = (with_own[:, :, 1:] & ~with_own[:, :, :-1]).sum(axis=-1) + with_own[:, :, 0]
    seen_by_some = folded.any(axis=1)[:, own]  # (b, Lq): the query's own key is some query's key (not padding)
    apart = (starts > 1) & attending & seen_by_some
    if not apart.any() or _alone(folded, own, apart):
        return None
    b, q = (int(i) for i in np.argwhere(apart)[0])
    keys = np.flatnonzero(folded[b, q])
    hidden = int((attending & seen_by_some).sum())
    return Finding("own-token-hidden", (
        f"batch row {b}: query {q} sees {_runs(keys)} but not key {int(own[q])}, its own token; no query of this "
        f"self-attention that sees any key sees its own ({hidden} such queries whose own key others see): the mask "
        f"laid off the tokens, read the other way round (True = masked handed where True = attend is read?) or its key "
        f"positions shifted"), expected="each query sees its own token", source="a self-attention's own keys",
        cell=(b, q, int(own[q])))


def _alone(folded: np.ndarray, own: np.ndarray, apart: np.ndarray) -> bool:
    """Some judged query hides its own key alone: each key beside it that some query of its row sees (a real token),
    it sees. A mask read the other way round or shifted hides what the meant mask kept around the token, a run with
    its neighbours (a window, a group, a causal prefix); one that takes a query's own token out between keys it keeps
    means to (RetroMAE's enhanced decoder: each position hides its own token and a sample of whole words)."""
    k_len = folded.shape[2]
    real = folded.any(axis=1)  # (b, Lk)
    rows, at = np.nonzero(apart)
    keys = own[at]
    beside, kept = np.zeros(len(keys), bool), np.ones(len(keys), bool)
    for step in (-1, 1):
        other = np.clip(keys + step, 0, k_len - 1)
        there = (keys + step >= 0) & (keys + step < k_len) & real[rows, other]
        beside |= there
        kept &= ~there | folded[rows, at, other]
    return bool((beside & kept).any())


def _numbered_from(folded: np.ndarray, own: np.ndarray, attending: np.ndarray) -> bool:
    """Every attending query sees the key `d` before the one its stated position names, for one d >= 1 (the first such
    query's last key seen before its position sets d): the mask keeps to the tokens, whose stated positions count from
    d (alpa's OPT: `cumsum(mask) * mask + padding_idx`, the first token at position 2 and cache slot 0)."""
    b, q = (int(i) for i in np.argwhere(attending)[0])
    before = np.flatnonzero(folded[b, q, :own[q]])
    if not len(before):
        return False
    shifted = own - (int(own[q]) - int(before[-1]))
    if shifted.min() < 0:
        return False
    return bool((folded[:, np.arange(len(own)), shifted] | ~attending).all())


def _runs(keys: np.ndarray) -> str:
    """Key indices as runs, the first four: `keys 0-3, 7`."""
    parts = spans(keys).split(", ")
    return ("key " if len(keys) == 1 else "keys ") + ", ".join(parts[:4]) + (", ..." if len(parts) > 4 else "")


RULES = (
    Rule("own-token-hidden", "wrong", "steps", "a self-attention whose queries never see their own token while seeing "
         "keys apart from it: the mask read the other way round or its key positions shifted", own_hidden),
)
