"""A model call handed a 2-D attention_mask that stops before its own tokens, whose attention hides them from themselves.

A model call's `attention_mask` (B, W) says, per batch row, which of the positions 0 .. W - 1 are tokens: the cached
ones and the call's own. A call that places its queries at `cache_position` p >= W (a decode step behind a cache) was
handed a mask that says nothing of its own tokens; transformers pads such a mask with zeros up to the keys
(masking_utils' `prepare_padding_mask`), so the new tokens read as padding. A generate loop written by hand that
updates `input_ids` and `cache_position` but never appends a 1 to the mask for each token it feeds
(tenstorrent/tt-xla#2953: a prompt-length mask against a StaticCache of max_cache_len) makes every decode query see
the prompt and neither itself nor the tokens generated before it.

Said only where both hold: the mask's width is at most a query's position (the call's own statement), and in the
attention calls the model call made, every batch row whose query attends hides that query's own key (the key at its
position) in every head: the mask ran short. Quiet where the model extends the mask itself (the query sees its own
key), on cross-attention, where the queries' places among the keys are not known, and where the model call states no
cache_position and is handed no cache (LongT5's and Pegasus-X's blocks place queries past the mask's width).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.checks.tokens import _ids, _pad
from maskcli.text import Finding


def _mask(top) -> np.ndarray | None:
    """The model call's 2-D attention_mask of 0s and 1s (B, W), where it was handed one."""
    mask = top.arguments.get("attention_mask")
    if not isinstance(mask, np.ndarray) or mask.ndim != 2 or mask.dtype.kind not in "biu" or not mask.size:
        return None
    return mask


def _stated(top) -> np.ndarray | None:
    """The model call's `cache_position` (its queries' positions), where it was handed one."""
    at = top.arguments.get("cache_position")
    return at if isinstance(at, np.ndarray) and at.ndim == 1 and at.size and at.dtype.kind in "iu" else None


def _steps(run: Run, top, said: set):
    """(call, its queries' positions) of each self-attention call `top` made over more keys than queries, stored and
    placed among its keys, at a site not said yet."""
    for call in run.made_by(top):
        if call.where in said or call.stored is None or cross(call) or call.shape[2] >= call.shape[3]:
            continue
        _, own, positions = run.placed(call)
        if positions and len(own) == call.shape[2]:
            yield call, own


def mask_short(run: Run) -> list:
    """The first attention call of each site, in a model call whose attention_mask stops before its queries' positions,
    whose attending rows each hide every query's own key past the mask's end."""
    found, said = [], set()
    for top in run.tops:
        mask = _mask(top)
        if mask is None:
            continue
        stated, width = _stated(top), mask.shape[1]
        if stated is None and top.arguments.get("past_key_values") is None:
            continue  # (no position stated and no cache handed: queries placed past the mask are blocks, not steps)
        for call, own in _steps(run, top, said):
            at = own if stated is None else stated  # (no cache_position handed: where the run places the queries)
            if not np.array_equal(own, at) or int(own.max()) >= call.shape[3] or int(own.max()) < width:
                continue
            cells = keep(call)
            if cells is None:
                continue
            past = np.flatnonzero(own >= width)  # (the queries the mask says nothing of)
            seen = cells.any(axis=(1, 3))  # (rows, Lq): a query that attends some key, in some head
            mine = cells[:, :, past, own[past]].any(axis=1)  # (rows, past queries): its own key seen in some head
            attending = seen[:, past]
            if not attending.any() or (mine & attending).any():
                continue
            b, i = (int(x[0]) for x in np.nonzero(attending))
            p = int(own[past[i]])
            said.add(call.where)
            fed = p > width and not cells[b, :, past[i], width:p].any()
            found.append((call, Finding("attention-mask-short", (
                f"the model call at step {call.step} is handed an attention_mask of width {width}, but places its "
                f"queries at {_placed(at, stated is not None)}: the mask says nothing of the call's own tokens, and "
                f"query {p} of batch row {b} does not see its own key"
                + (f", nor keys {width} .. {p - 1} (the tokens fed since the mask's end)" if fed else "")
                + ": the mask was not extended with a 1 for each token fed"),
                expected=f"an attention_mask of width {int(at.max()) + 1} or more (the last one extended by the "
                         f"tokens fed)", source=f"attention_mask ({mask.shape[0]}, {width}) of {top.where}",
                cell=(b, p, p))))
    return found


def own_masked(run: Run) -> list:
    """The first attention call of each site, in a model call behind a cache, whose attention_mask marks a query's own
    position 0 although the token fed there is not the pad id, and whose query does not see its own key."""
    found, said = [], set()
    for top in run.tops:
        mask, ids, pad = _mask(top), _ids(top.arguments), _pad(top.arguments)
        if mask is None or ids is None or pad is None or ids.ndim != 2 or ids.shape[0] != mask.shape[0]:
            continue
        for call, own in _steps(run, top, said):
            q_len, k_len = call.shape[2:]
            if ids.shape[1] != q_len or mask.shape[1] != k_len \
                    or not np.array_equal(own, np.arange(k_len - q_len, k_len)):
                continue  # (the mask spans the keys, the queries its last positions: a step behind a cache)
            cells = keep(call)
            if cells is None or cells.shape[0] not in (1, mask.shape[0]):
                continue
            cells = np.broadcast_to(cells, (mask.shape[0], *cells.shape[1:]))
            marked = (mask[:, own] == 0) & (ids != pad[0])  # (B, Lq): a token fed, marked padding
            attends = cells.any(axis=(1, 3))
            mine = cells[:, :, np.arange(q_len), own].any(axis=1)
            bad = marked & attends & ~mine
            if not bad.any():
                continue
            b, q = (int(x[0]) for x in np.nonzero(bad))
            p = int(own[q])
            said.add(call.where)
            found.append((call, Finding("own-token-masked", (
                f"the model call at step {call.step} feeds batch row {b} token id {int(ids[b, q])} at position {p}, "
                f"but its attention_mask marks position {p} padding (0), and that query does not see its own key; "
                f"the id is not {pad[1]} ({pad[0]}): the mask was extended with a 0 for a token fed"),
                expected=f"attention_mask[{b}, {p}] = 1 (a token fed is a token)",
                source=f"attention_mask ({mask.shape[0]}, {mask.shape[1]}) of {top.where}", cell=(b, p, p))))
    return found


def _placed(at: np.ndarray, stated: bool) -> str:
    """"cache_position 5 .. 7" where the model call handed them, else "position 5" / "positions 5 .. 7"."""
    first, last = int(at.min()), int(at.max())
    word = "cache_position" if stated else "position" if first == last else "positions"
    return f"{word} {first}" if first == last else f"{word} {first} .. {last}"


RULES = (
    Rule("attention-mask-short", "wrong", "steps", "a model call handed a 2-D attention_mask narrower than its queries' "
         "cache_position, whose attention hides each query's own token: the mask not extended for the tokens fed "
         "(tt-xla#2953: a prompt-length mask against a static cache)", mask_short),
    Rule("own-token-masked", "wrong", "steps", "a model call behind a cache whose attention_mask marks a token it feeds "
         "(not the pad id) padding, its query blind to its own key: the mask extended with a 0 for a generated token",
         own_masked),
)
