"""Which queries and keys of each batch row are real tokens, resolved before a rule compares rows.

A rule that holds on an unpadded batch must hold on a padded one: it reads the real queries and keys of
each batch row, never the clean shape of one example. The padding is, in this order:

1. stated by the model call (the program's own word, so a rule may call a mask that contradicts it wrong):
   its `attention_mask` (1 = a real token, as Hugging Face and BERT take it; a vision tower's `patch_attention_mask`
   / `patch_attn_mask`, True on its real patches, flattened in patch order), a `key_padding_mask` /
   `padding_mask` / `pad_mask` (True = padding, as torch names it), a plain `mask` / `input_mask` whose rows are a
   right-padded batch's (1 = a real token), `lengths` / `seq_lens` (each row's real
   tokens first, or last where its input ids lead with the pad id), or its input ids equal to the pad id the
   program states (config `pad_token_id`, its embedding's `padding_idx`; else the tokenizer's it holds, on the tokenizer's
   padding side) in a run at one end of each row (some row unpadded; or every row padded to a static length, two
   pads at least each, where the pad id is no EOS or BOS), or left-padded prompts followed by right-padded completions
   (a run at each end of each row: an RL trainer's prompt + completion ids);
2. else read off the mask: a key no real query of a batch row sees while a real query of another row does.
   Query rows that see no key, and rows that see every key where other rows of the same batch row do not
   (Hugging Face's SDPA path unmasks the padding rows so that they give no NaN), are not real queries there.

Query rows whose own position is a padding key are padding too; no rule fires on them.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

import numpy as np

from maskcli.checks.context import keep, queries, real_queries, runs
from maskcli.checks.padvalue import padded_with_id
from maskcli.checks.placing import positions_said
from maskcli.checks.idspositions import positions_padding
from maskcli.checks.plainpad import ids_padding, named_padding, segment_padding
from maskcli.checks.realfold import folded

PADDING_TRUE = ("key_padding_mask", "padding_mask", "pad_mask")  # True (1) = padding
REAL_TRUE = ("attention_mask", "patch_attention_mask", "patch_attn_mask")  # 1 = a real token (a real patch)
LENGTHS = ("lengths", "seq_lens", "seq_lengths", "input_lengths")
TOKENS = ("input_ids", "idx", "tokens")


def handed_ids(arguments: dict, names: tuple = TOKENS, first: bool = True) -> tuple[str, np.ndarray] | None:
    """(its name, (B, L)) of the token ids a model call was handed: the first of `names` it holds 2-D, else (`first`) a
    hand-written forward's first argument (trace/tops.py's `first_ids`); None where it holds neither."""
    name = next((n for n in names if isinstance(arguments.get(n), np.ndarray) and arguments[n].ndim == 2), None)
    if name is not None or not first:
        return None if name is None else (name, arguments[name])
    held = arguments.get("first_ids")
    if isinstance(held, tuple) and len(held) == 2 and isinstance(held[1], np.ndarray) and held[1].ndim == 2:
        return held
    return None
SOURCE = ("src_tokens", "src", "source", "src_ids", "source_ids", "input_src")  # (fairseq's, Uni-Mol's, torchtext T5's
# encoder ids: the tokens where no target side is handed beside them; arguments.py reads them where no cross-attention is)
TARGETS = ("trg", "tgt", "target", "trg_ids", "tgt_ids", "target_ids", "input_trg", "input_tgt", "trg_tokens", "tgt_tokens")
PLAIN = ("mask", "input_mask")  # 1 = a real token, read where its rows are right padding (_right_padding), or the
# ids' padding (plainpad.py)


@dataclass(frozen=True)
class Real:
    """Bool (B, Lk) real keys and (B, Lq) real queries of one call, and the statement they come from."""

    keys: np.ndarray
    queries: np.ndarray
    source: str | None  # "attention_mask of Model", ...; None where read off the mask
    sure: bool = False  # the program states it outright (a contradiction is wrong, not suspicious)


def _edge(pad: np.ndarray) -> bool:
    """Every row's padding one run at the start or at the end (a padded batch), and some row has none."""
    if not pad.any() or pad.all(axis=1).any() or not (~pad.any(axis=1)).any():
        return False
    return _one_run_at_an_end(pad)


def _one_run_at_an_end(pad: np.ndarray) -> bool:
    """Every row's padding one run at its start, or every row's one run at its end."""
    count = pad.sum(axis=1, keepdims=True)
    columns = np.arange(pad.shape[1])[None, :]
    return bool(((columns < count) == pad).all() or ((columns >= pad.shape[1] - count) == pad).all())


def _static(pad: np.ndarray) -> bool:
    """Every row padded, each one run of two at least at the same end and none all padding: a batch padded to a
    static length (an exported program's fixed input, `padding="max_length"`), so no row is left unpadded for _edge."""
    if pad.sum(axis=1).min() < 2 or pad.all(axis=1).any():
        return False
    return _one_run_at_an_end(pad)


def _prompt_and_completion(pad: np.ndarray, side: str | None) -> bool:
    """Left-padded prompts followed by right-padded completions (an RL trainer's `cat([prompt_ids, completion_ids])`:
    TRL's GRPO, verl, OpenRLHF): each row's padding a run at its start and one at its end and nothing between, some row
    with a leading run and some with none, on a tokenizer padded on the left where it states a side."""
    if side not in (None, "left") or not pad.any() or pad.all(axis=1).any():
        return False
    columns = np.arange(pad.shape[1])[None, :]
    lead = np.where(pad.all(axis=1), pad.shape[1], np.argmin(pad, axis=1))[:, None]
    trail = np.argmin(pad[:, ::-1], axis=1)[:, None]
    runs = (columns < lead) | (columns >= pad.shape[1] - trail)
    return bool((runs == pad).all() and (lead > 0).any() and (lead == 0).any())


def _right_padding(given: np.ndarray) -> bool:
    """0/1 rows each a run of 1s from the start, every row with one, one row all 1s and one not: a right-padded batch's
    mask of real tokens, as held.py reads a plain `mask` (a loss mask of a prompt is 0s at the start; a square one may be
    a causal mask over the cells, so `stated` reads none whose rows are as many as its columns)."""
    if given.shape[0] < 2 or given.min() < 0 or given.max() > 1:
        return False
    count = given.sum(axis=1)
    if count.min() < 1 or count.max() != given.shape[1] or count.min() == given.shape[1]:
        return False
    return bool(((np.arange(given.shape[1])[None, :] < count[:, None]) == (given == 1)).all())


def _on_side(pad: np.ndarray, side: str | None) -> bool:
    """Every row's pad run on the tokenizer's padding side, where it states one."""
    count = pad.sum(axis=1, keepdims=True)
    columns = np.arange(pad.shape[1])[None, :]
    at = {"left": columns < count, "right": columns >= pad.shape[1] - count}.get(side)
    return at is None or bool((at == pad).all())


def stated_once(memo: dict, top, rows: int, length: int) -> tuple[np.ndarray, str, bool] | None:
    """stated(top, rows, length), read once per model call and length into `memo` (a rule's own: every layer of one
    model call asks it the same)."""
    key = (id(top), rows, length)
    if key not in memo:
        memo[key] = stated(top, rows, length)
    return memo[key]


def stated(top, rows: int, length: int) -> tuple[np.ndarray, str, bool] | None:
    """(bool (rows, length) real tokens, the argument that says it, whether outright) the model call states for its
    `length` tokens; None where it states none, or states two masks that differ (an encoder's and a decoder's). Its
    input ids are read only where it is given no mask."""
    if top is None:
        return None
    arguments, found = top.arguments, []
    tokens = next((arguments[n] for n in TOKENS if isinstance(arguments.get(n), np.ndarray)), None)
    if (padded := padded_with_id(arguments)) is not None:  # (a mask padded with the pad id: its 1s the tokens, padvalue.py)
        found.append((arguments["attention_mask"] == 1, f"attention_mask (padded with the pad id {padded}, not 0)", True))
    for name in (*REAL_TRUE, *PADDING_TRUE):
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape[1] == length and given.size \
                and given.min() >= 0 and given.max() <= 1 and given.shape[0] in (1, rows):
            turned = name in REAL_TRUE or name in EITHER_WAY and _ones_are_tokens(given, tokens)
            found.append(((given == 1) if turned else (given == 0), name, True))
    if tokens is None and "first_ids" in arguments and "first_ids_beside" not in arguments:  # (`forward(self, x)`:
        tokens = arguments["first_ids"][1]  # trace/tops.py; not a seq2seq's source ids beside its target ids)
    source = None if tokens is not None or any(n in arguments for n in TARGETS) else handed_ids(arguments, SOURCE, False)
    tokens = tokens if source is None else source[1]
    for name in PLAIN:
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape[1] == length and given.shape[0] == rows \
                and rows != length and (_right_padding(given) or ids_padding(given, tokens)):
            found.append((given == 1, name, True))
    tokens = tokens if tokens is not None and tokens.ndim == 2 and tokens.shape == (rows, length) else None
    nested, folded = arguments.get("nested_ids"), ""
    if tokens is None and isinstance(nested, tuple) and nested[1].shape[-1] == length \
            and int(np.prod(nested[1].shape[:-1])) == rows:  # (ids of more axes, folded into the call's rows: tops.py)
        tokens, folded = nested[1].reshape(rows, length), f" (`{nested[0]}` {tuple(nested[1].shape)}, its leading axes folded into the call's rows)"
    over = arguments.get("lengths_over", length)  # (the positions the lengths count: trace/padded.lengths_over)
    for name in LENGTHS:
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and given.shape == (rows,) and given.min(initial=0) >= 0 \
                and given.max(initial=0) <= length and over >= length:  # (keys beyond the input's: not placed)
            columns = np.arange(length)[None, :]
            left = tokens is not None and "pad_id" in arguments and (tokens[:, 0] == arguments["pad_id"]).any()
            found.append(((columns >= length - given[:, None]) if left else (columns < given[:, None]), name, True))
    pad_id, by = arguments.get("src_pad_id" if source is not None and "src_pad_id" in arguments else "pad_id"), ""
    if not isinstance(pad_id, int) and isinstance(arguments.get("tokenizer_pad_id"), int):
        pad_id, by = arguments["tokenizer_pad_id"], f" of {arguments.get('tokenizer', 'the tokenizer')}"
    # (a pad id that is also the EOS or BOS may end or start a real sequence)
    sure = pad_id not in {arguments.get(n) for n in ("eos_id", "tokenizer_eos_id", "tokenizer_bos_id")}
    at_pad = tokens == pad_id if tokens is not None and isinstance(pad_id, int) else None
    if not found and at_pad is not None and (
            (_edge(at_pad) or sure and _static(at_pad)) and (not by or _on_side(at_pad, arguments.get("padding_side")))
            or _prompt_and_completion(at_pad, arguments.get("padding_side"))):  # (a mask given wins)
        found.append((tokens != pad_id, f"input ids equal to the pad id {pad_id}{by}{folded}", sure))
    found += [(*named, True)] if (named := named_padding(arguments, rows, length)) is not None else []
    found += [(real, words, True) for real, words in segment_padding(arguments, rows, length, _edge)]
    placed = positions_padding(tokens, arguments.get("position_ids")) if not found and tokens is not None else None
    if placed is not None:  # (the ids' run of one id where the positions stay put: idspositions.py)
        found.append((placed[0], f"input ids padded with {placed[1]} where their position_ids stay put{folded}", True))
    if not found:
        return None
    first = np.broadcast_to(found[0][0], (rows, length))
    if any(not np.array_equal(np.broadcast_to(real, (rows, length)), first) for real, _, _ in found[1:]):
        return None
    real, name, sure = found[0]
    return first, (name if name.startswith("input ids") else f"{name} of {top.where}"), sure


def _ones_are_tokens(given: np.ndarray, tokens) -> bool:
    """A mask of a name both conventions use (EITHER_WAY) whose 1s are the tokens, by the ids beside it: read as
    torch's (1 = padding) it calls some row all padding and not every row, while the ids hold one id at each of its 0s
    and never that id at a 1 (candle's ModernBERT `pad_mask`, 1 on the tokens of a right-padded batch)."""
    if tokens is None and given.ndim == 2:
        return _whole_row_of_tokens(given)
    if not isinstance(tokens, np.ndarray) or tokens.shape != given.shape or not (given == 0).any():
        return False
    whole = (given == 1).all(axis=1)
    at_zeros = np.unique(tokens[given == 0])
    return bool(whole.any() and not whole.all() and len(at_zeros) == 1 and not (tokens[given == 1] == at_zeros[0]).any())


def _whole_row_of_tokens(given: np.ndarray) -> bool:
    """A mask of a name both conventions use, with no ids beside it, whose 1s are the tokens by its rows alone: read as
    torch's it calls some row all padding (an empty sequence in the batch), while read with 1 = a token every row holds
    some and its 0s are one run at the same end of each row, some row whole (a padded batch: the Nemotron ASR encoder's
    `padding_mask`, 1 on its frames, of transformers PR #48817)."""
    whole, some = (given == 1).all(axis=1), (given == 1).any(axis=1)
    return bool(given.shape[0] > 1 and whole.any() and not whole.all() and some.all() and _one_run_at_an_end(given == 0))


EITHER_WAY = ("padding_mask", "pad_mask")  # True = padding in torch / fairseq; True = a real token in Keras / Flax


def kept_turned(source: str, real: np.ndarray, cells: np.ndarray, own: np.ndarray) -> bool:
    """The statement is a mask whose name both conventions use (EITHER_WAY: `stated` reads it as torch does) and the
    cells (rows, Lq, Lk) keep exactly to it read the other way round: every row has a token it then calls real, no such
    query sees another key, and each sees some key. Its polarity is then the program's other convention (KerasHub's
    `padding_mask`, True on the tokens, AND-ed with the causal mask), so no statement of the program's contradicts it;
    a mask that keeps to neither reading is still read as torch's."""
    if source.split(" ")[0] not in EITHER_WAY:
        return False
    turned = ~real
    if not turned.any(axis=1).all():
        return False
    mine = real_queries(turned, own)
    length = real.shape[1]
    if (cells[:, :, :length] & mine[:, :, None] & real[:, None, :]).any() or cells[:, :, length:][mine].any():
        return False
    return bool(mine.any() and cells[mine].any(axis=-1).all())


def read_off(cells: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(real keys (B, Lk), real queries (B, Lq)) read off bool cells (B, Lq, Lk) (over the heads)."""
    rows, q_len, k_len = cells.shape
    empty = ~cells.any(axis=-1)
    full = cells.all(axis=-1) & (q_len > 1) & (own < k_len - 1)[None, :]  # (the last query sees every key: causal)
    full &= ~full.all(axis=1, keepdims=True)  # rows that see every key where others do not (unmasked padding rows)
    counted = ~(empty | full)
    return _real((cells & counted[:, :, None]).any(axis=1), empty, own)  # (B, Lk): keys a counted query sees


def read_off_runs(starts: np.ndarray, ends: np.ndarray, own: np.ndarray, k_len: int) -> tuple[np.ndarray, np.ndarray]:
    """read_off of cells that keep one run [start, end) of keys a row (starts, ends: (B, Lq), clipped to the keys),
    without a pass over the cells: a counted query's run added to its row's keys by a difference array."""
    rows, q_len = starts.shape
    empty = starts >= ends
    full = (starts <= 0) & (ends >= k_len) & (q_len > 1) & (own < k_len - 1)[None, :]
    full &= ~full.all(axis=1, keepdims=True)
    counted = ~(empty | full)
    b, q = np.nonzero(counted)
    size, base = rows * (k_len + 1), b * (k_len + 1)  # (np.bincount: np.add.at's unbuffered adds cost more than the rows)
    steps = np.bincount(base + starts[b, q], minlength=size) - np.bincount(base + ends[b, q], minlength=size)
    return _real(np.cumsum(steps.reshape(rows, k_len + 1)[:, :k_len], axis=1) > 0, empty, own)


def _real(seen: np.ndarray, empty: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(real keys, real queries) of read_off: keys no counted query of a row sees, where another row's sees them, are
    padding; a query is real where its own key is and it sees some key."""
    rows, k_len = seen.shape
    padded = ~seen & seen.any(axis=0, keepdims=True) if rows > 1 else np.zeros_like(seen)
    keys = ~padded
    inside = (own >= 0) & (own < k_len)
    mine = np.zeros(empty.shape, dtype=bool)
    mine[:, inside] = keys[:, own[inside]]
    return keys, mine & ~empty


def _runs(stored: dict | None, rows: int, q_len: int, k_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(starts, ends) (rows, Lq) of a stored mask of one run of keys a row and one head plane (its rows over the heads
    are those runs: context.runs); None for any other."""
    if stored is None or stored["planes"][1] != 1 or stored["planes"][0] not in (1, rows):
        return None
    found = runs(stored, k_len)
    return None if found is None else tuple(np.broadcast_to(one[:, 0], (rows, q_len)) for one in found)


def resolve(call, top, cells: np.ndarray, own_cells: bool = False) -> Real:
    """The real keys and queries of `call` (cells: bool (B, Lq, Lk) over the heads, batch rows broadcast), stated
    where the model call states them for the call's keys, else read off the cells. `own_cells`: the cells are the call's
    own stored mask over its heads (by_row(keep(call))), read off its intervals where it keeps one a row."""
    rows, q_len, k_len = cells.shape
    own = queries(call, top)
    said = stated(top, rows, k_len) or folded(call, top, rows, k_len, stated)  # (heads folded in: realfold.py)
    if said is None:
        bounds = _runs(call.stored, rows, q_len, k_len) if own_cells else None
        keys, mine = read_off(cells, own) if bounds is None else read_off_runs(*bounds, own, k_len)
        return Real(keys, mine, None)
    keys, source, sure = said
    if kept_turned(source, keys, cells, own):  # (KerasHub's `padding_mask`, True on the tokens, kept to exactly)
        keys = ~keys
    inside = (own >= 0) & (own < k_len)
    mine = np.zeros((rows, q_len), dtype=bool)
    mine[:, inside] = keys[:, own[inside]]
    return Real(keys, mine, source, sure)


def by_row(cells: np.ndarray, rows: int | None = None) -> np.ndarray:
    """Bool (B, Lq, Lk) over the heads of keep cells (b, h, Lq, Lk), batch rows broadcast to `rows`."""
    found = cells.any(axis=1)
    return found if rows is None else np.broadcast_to(found, (rows, *found.shape[1:]))


def behind_cache(run, call) -> np.ndarray | None:
    """Bool (B, Lk) real keys for a later step at `call`'s site whose padding is read off its own few query rows (a
    chunk or window cut in another batch row reads as padding there): the padding the site's latest prefill showed,
    read off its many rows, the keys after it real (the cache holds the same positions; the new tokens are real);
    None for a prefill, or where no earlier prefill at the site was kept."""
    own = queries(call, run.top(call))
    if own[:1].tolist() == [0]:
        return None
    heads = run.__dict__.get("_prefills")
    if heads is None:  # each site's prefills and their call indices, in order (made once per run)
        heads = run.__dict__["_prefills"] = {}
        for where, calls in run.sites().items():
            firsts = [c for c in calls if queries(c, run.top(c))[:1].tolist() == [0]]
            heads[where] = (firsts, [c.index for c in firsts])
    site, indices = heads.get(call.where, ([], []))
    at = bisect.bisect_left(indices, call.index)
    if at == 0:
        return None
    head, held = site[at - 1], run.__dict__.setdefault("_prefill_keys", {})
    if head.index not in held:
        cells = keep(head)
        keys = None
        if cells is not None:
            mine = queries(head, run.top(head))
            keys, _ = read_off(by_row(cells, max(cells.shape[0], head.shape[0])), mine)
            keys = keys.copy()
            keys[:, int(mine.max(initial=-1)) + 1:] = True  # (a static cache's unwritten slots: not padding)
        held[head.index] = keys
    keys = held[head.index]
    if keys is None or keys.shape[1] > call.shape[3]:
        return None
    found = np.ones((keys.shape[0], call.shape[3]), dtype=bool)
    found[:, :keys.shape[1]] = keys
    return found


def slack_dropped(cells: np.ndarray, own: np.ndarray, given=None) -> tuple[np.ndarray, np.ndarray]:
    """The cells without the key columns no query of any row sees that lie between seen keys and before every query
    (a paged cache's unused block slots ahead of a prefill's new tokens: vLLM's context_attention_fwd joins the cached
    context's last block, slack and all, to the new tokens), the queries' positions moved back by as many: such columns
    hold no token, and left in, every key before them sits that many positions further from the queries. Nothing is
    dropped where the model call hands an attention_mask (`given`): its columns are the cells'."""
    if given is not None:  # (the model call's attention_mask states the keys: its columns are the cells')
        return cells, own
    seen = cells.any(axis=(0, 1, 2))
    held = np.flatnonzero(seen)
    if held.size == 0 or own[-1] != cells.shape[-1] - 1:
        return cells, own
    gap = ~seen
    gap[:held[0]] = False
    gap[held[-1] + 1:] = False
    if not gap.any() or np.flatnonzero(gap)[-1] >= own[0]:
        return cells, own
    return cells[..., ~gap], own - int(gap.sum())


def trimmed(run, call) -> np.ndarray | None:
    """The positions of a call's queries counted along its site, where its cache dropped keys from the front (a chunked
    or sliding cache trimmed to its size: mlx-lm's ChunkedKVCache.maybe_trim_front) so that key column j is no longer
    position j; None where the keys are every position so far, or where the call or the model call states the
    positions (queries() reads them), or where the count is unsure.

    Counted from the site's last call whose keys are its several queries, or its first (a pass over an empty cache:
    positions 0 ..);
    each later call's queries follow the ones before. A call of several queries whose keys did not grow by as many
    (a speculative step's keys cropped back) ends the count: its positions are not known from the lengths alone."""
    q_len, k_len = call.shape[2:]
    own = queries(call, run.top(call))
    if own.size == 0 or int(own[-1]) != k_len - 1 or positions_said(call, run.top(call)):
        return None  # (positions stated, or not the end of the keys: queries() placed them)
    held = run.__dict__.setdefault("_trimmed", {})
    if call.where not in held:  # each site's counted starts, made once per run
        starts, count, before, site = {}, None, None, run.sites().get(call.where, [])
        tops = [run.top(other) for other in site]
        made = Counter(id(top) for top in tops if top is not None)  # (a model call that ran the site more than once
        for other, top in zip(site, tops):  # ran several sequences through it, a kernel call per request: no count)
            q, k = other.shape[2:]
            if q == k and (q > 1 or count is None):  # (one query over one key after others: a cache trimmed to one)
                count = 0
            elif count is not None and q > 1 and before is not None and k != before + q:
                count = None
            count = None if top is not None and made[id(top)] > 1 else count
            starts[other.index] = count
            count, before = (None if count is None else count + q), k
        held[call.where] = starts
    start = held[call.where].get(call.index)
    if start is None or start + q_len <= k_len:
        return None
    return np.arange(start, start + q_len)
