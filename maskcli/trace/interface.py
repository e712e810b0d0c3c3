"""Hugging Face's AttentionInterface while tracing: each layer's attention call with what HF told it, and the mask
its arguments mean where no kernel call below it was seen.

Every HF model looks its attention function up in an AttentionInterface
(`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)`,
or `ALL_ATTENTION_FUNCTIONS[name]`): sdpa, eager (the model module's own
eager_attention_forward, the default of that lookup), flash_attention_2/3, flex_attention,
and whatever a user registered. While tracing, the lookups return the function wrapped, so
each call is seen with its module's layer_idx, sliding_window, is_causal, scaling,
position_ids and cu_seq_lens_q/k. The kernel calls made inside it (SDPA, a softmax,
flash_attn, flex) are recorded as before and carry these as details["hf"]; only where none
was recorded (a kernel maskcli cannot see, a registered function of the user's own, or
`--api hf` alone) is the interface call itself recorded, api "hf", with the mask its
arguments mean: a 4-D attention_mask as SDPA reads it; otherwise as HF's flash path
(_flash_attention_forward) applies them: a 2-D padding mask unpadded, cu_seq_lens_q/k as
packed documents, position_ids restarting at their lowest value (one batch row) as documents,
else causal (is_causal, else module.is_causal) and sliding_window (a window of W keys when
there are more than W), each bottom-right aligned as flash_attn aligns them.

transformers is never imported here: its module is handed over once the program loaded it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from maskcli.intervals import Intervals
from maskcli.tracefile import by_row
from maskcli.trace.flash import aligned, rows_intervals, short
from maskcli.trace.masks import Seen, _as_4d, _dtype, _keep

MODULE = "transformers.modeling_utils"
NAMES = ("sliding_window", "is_causal", "scaling", "dropout", "softcap", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
         "max_length_k", "position_ids")


def patch(trace, modeling_utils) -> list:
    """AttentionInterface's lookups made to return wrapped functions; the (class, name, original) triples to put back."""
    cls = modeling_utils.AttentionInterface
    wrapped: dict[int, tuple] = {}

    def wrap(function, name):
        if trace in getattr(function, "_maskcli_interface", ()) or not callable(function):  # (another trace's: wrapped again)
            return function
        found = wrapped.get(id(function))
        if found is None:
            found = wrapped[id(function)] = (function, _wrapper(trace, function, name))
        return found[1]

    getitem, get_interface = cls.__getitem__, cls.get_interface

    def __getitem__(self, key):
        return wrap(getitem(self, key), key)

    def get_interface_(self, attn_implementation, default):
        return wrap(get_interface(self, attn_implementation, default), attn_implementation)

    def registered_back() -> None:  # (a program that looked a function up while tracing and registered it again,
        # axolotl's patch and unpatch of "sdpa", left the trace's wrapper in the registry: its own function goes back)
        originals = {id(wrapper): function for function, wrapper in wrapped.values()}
        for mapping in (cls.__dict__.get("_global_mapping"), getattr(modeling_utils.ALL_ATTENTION_FUNCTIONS, "_local_mapping", None)):
            if isinstance(mapping, dict):
                for key, value in list(mapping.items()):
                    if id(value) in originals:
                        mapping[key] = originals[id(value)]

    undo = [(cls, name, cls.__dict__.get(name)) for name in ("__getitem__", "get_interface")]
    cls.__getitem__, cls.get_interface = __getitem__, functools.wraps(get_interface)(get_interface_)
    return undo + [registered_back]


def unpatch(undo: list) -> None:
    for entry in undo:
        if callable(entry):
            entry()
            continue
        cls, name, original = entry
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


def _wrapper(trace, function, name):
    @functools.wraps(function)
    def interface(*args, **kwargs):
        if not trace.active or trace.busy or trace.within or torch.compiler.is_dynamo_compiling():
            return function(*args, **kwargs)
        try:
            told = details(name, args, kwargs)
        except Exception as error:  # noqa: BLE001 - tensors without values (export, meta): the call is the program's
            told = {"attn_implementation": name, "error": f"{type(error).__name__}: {str(error)[:120]}"}
        given = _given(args, kwargs)
        query, module, key = given.get("query"), given.get("module"), given.get("key")
        frame = {"hf": told, "seen": 0, "query": tuple(query.shape) if isinstance(query, torch.Tensor) else None,
                 "lengths": (query.shape[-2], key.shape[-2]) if isinstance(query, torch.Tensor) and isinstance(
                     key, torch.Tensor) and query.dim() >= 3 and key.dim() >= 3 else None,  # (HF's (B, H, L, D))
                 "groups": getattr(module, "num_key_value_groups", 1),
                 "sink_keys": key.shape[-2] if isinstance(getattr(module, "sinks", None), torch.Tensor) and isinstance(key, torch.Tensor) else None}
        trace.interfaces.append(frame)
        try:
            return function(*args, **kwargs)
        finally:
            trace.interfaces.pop()
            if not frame["seen"]:
                trace.capture(read, args, {**kwargs, "_hf": frame["hf"]})

    interface._maskcli_interface = (*getattr(function, "_maskcli_interface", ()), trace)  # the traces it goes through
    return interface


def made_in(call, frame: dict) -> None:
    """A kernel call made inside an interface call carries what HF told it; where it is over fewer queries or keys
    than HF handed the function, it is a part of that call (a ring's step, a flash tile: details['hf_part']), its
    queries' and keys' positions the function's own split, not HF's."""
    call.details["hf"] = frame["hf"]
    frame["seen"] += 1
    lengths = frame["lengths"]
    if lengths is not None and (call.shape[2] < lengths[0] or call.shape[3] < lengths[1]):
        call.details["hf_part"] = lengths


def unpack_gqa(seen: Seen, frame: dict) -> None:
    """An SDPA call HF's sdpa made with pack_gqa, read back as the model computed it: one query of H heads, (B, H, 1, Lk).

    For one query and n_rep = num_key_value_groups > 1, HF reshapes the query (B, H, 1, D) to (B, H_kv, n_rep, D)
    and passes the mask as is (B, 1, 1, Lk: its one row broadcasts over the n_rep rows), or reshaped the same way
    where it has H heads. The kernel's n_rep "query rows" are heads of one query, at the last position."""
    query, groups = frame.get("query"), frame.get("groups")
    if not isinstance(groups, int) or groups < 2 or query is None or len(query) != 4 or query[2] != 1:
        return
    batch, heads = query[0], query[1]
    if seen.details.get("enable_gqa") or len(seen.q) != 4 or seen.q[1:3] != (heads // groups, groups) or heads % groups:
        return  # not packed: repeat_kv or enable_gqa kept the query as it was
    b, h, rows, k_len = seen.shape
    if seen.make is not None:  # (unpacked as it is made: not at all where the store read this mask tensor already)
        make, packed = seen.make, seen.shape
        seen.make = lambda: unpacked_heads(make(), packed)
    elif seen.keep is not None:
        seen.keep = unpacked_heads(seen.keep, seen.shape)
    elif seen.intervals is not None:
        found, (pb, ph) = seen.intervals, seen.planes
        if found.starts.shape[1] != 1:
            if ph != h:
                return
            seen.intervals = Intervals.of(found.starts.reshape(pb * ph * rows, 1, -1), found.ends.reshape(pb * ph * rows, 1, -1),
                                          found.k_start, found.k_end)
            seen.planes = (pb, ph * rows)
    seen.details["pack_gqa"] = {"kernel_q": list(seen.q), "num_key_value_groups": groups}
    seen.shape, seen.q = (b, h * rows, 1, k_len), tuple(query)


def unpacked_heads(keep: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A packed GQA call's keep cells, broadcastable to its kernel shape (B, H_kv, n_rep, Lk), as the model meant them:
    (B, H_kv * n_rep, 1, Lk), n_rep query heads of one query. The one unpacking of the cells: the trace does it as a call
    is recorded (`unpack_gqa`), `model` after its run (hf/run.py, where no interface frame says the groups).

    Packed row i of key/value head j is query head j * n_rep + i, so a mask broadcast over the packed rows (one row,
    or one head) is each query head's too."""
    b, h, rows, k_len = shape
    return keep.expand(b, h, rows, k_len).reshape(b, h * rows, 1, k_len)


def leave_out_sink(seen: Seen, k_len: int | None) -> None:
    """A softmax one column wider than the `k_len` keys of a module with learned sinks, read as its keys alone: the one
    place the sink column is cut, as the call is recorded (trace: the interface frame's keys; `model`: its cache's).

    GPT-OSS's eager attention softmaxes torch.cat([attn_weights, sinks], dim=-1)
    (transformers/models/gpt_oss/modeling_gpt_oss.py, eager_attention_forward): the last column is each head's sink
    logit, on no key position and never masked. details["sink_column"] is the index of the column left out."""
    if k_len is None or seen.materialize() is None or seen.shape[3] != k_len + 1:
        return
    seen.details["sink_column"] = k_len
    seen.keep, seen.shape = seen.keep[..., :k_len], (*seen.shape[:3], k_len)


def _given(args: tuple, kwargs: dict) -> dict:
    """The interface's arguments by name: (module, query, key, value, attention_mask) first, as HF passes them."""
    return dict(zip(("module", "query", "key", "value", "attention_mask"), args)) | kwargs


def details(name: str, args: tuple, kwargs: dict) -> dict:
    """What HF told the call: its implementation, the module's layer_idx, and the arguments that shape masks."""
    given = _given(args, kwargs)
    found = {"attn_implementation": name, "layer_idx": getattr(given.get("module"), "layer_idx", None)}
    for key in NAMES:
        value = given.get(key)
        if value is not None:
            found[key] = short(value) if isinstance(value, torch.Tensor) else value
    if "is_causal" not in found and isinstance(getattr(given.get("module"), "is_causal", None), bool):
        found["module_is_causal"] = given["module"].is_causal  # (what HF's own functions fall back to)
    mask = given.get("attention_mask")
    found["attention_mask"] = None if mask is None else type(mask).__name__ if not isinstance(mask, torch.Tensor) else list(mask.shape)
    return found


def read(args: tuple, kwargs: dict) -> Seen:
    given = _given(args, kwargs)
    info = given.pop("_hf")
    q, k, v, mask = given["query"], given["key"], given["value"], given.get("attention_mask")
    batch, heads, q_len = q.shape[0], q.shape[1], q.shape[2]
    k_len = k.shape[2]
    causal = given.get("is_causal")
    causal = bool(getattr(given.get("module"), "is_causal", True) if causal is None else causal)
    window = given.get("sliding_window")
    details_ = {"hf": info, "causal": causal}
    seen = Seen("hf", (batch, heads, q_len, k_len), tuple(q.shape), tuple(k.shape), tuple(v.shape), _dtype(q), str(q.device), details=details_)
    if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask (flex_attention's)
        from maskcli.trace.flex import block_intervals

        seen.intervals, seen.planes = block_intervals(mask, q_len, k_len)
        details_["implicit"] = "the BlockMask given"
        return seen
    if mask is not None and mask.dim() == 4:  # cut to the keys given, as HF's sdpa and eager paths cut it
        seen.keep = _as_4d(_keep(mask[..., :k_len], details_), q_len, k_len)
        seen.sources = (mask,)
        details_["implicit"] = "the attention_mask given"
        return seen

    def sides(max_k: int) -> tuple[int, int]:  # HF hands flash a window only where it cuts keys (its max key length)
        return (window - 1, window - 1) if window is not None and max_k > window else (-1, -1)

    cu_q, cu_k = given.get("cu_seq_lens_q"), given.get("cu_seq_lens_k")
    positions = given.get("position_ids")
    if mask is None and cu_q is not None and cu_k is not None and given.get("max_length_q") is not None and given.get("max_length_k") is not None:
        details_["implicit"] = "cu_seq_lens_q/k"
        return _packed(seen, cu_q.cpu().numpy(), cu_k.cpu().numpy(), causal, sides(int(given["max_length_k"])), batch * q_len, batch * k_len)
    if mask is None and positions is not None and _packed_positions(positions, batch):
        flat = positions.reshape(-1).cpu().numpy()
        cu = np.append(np.flatnonzero(flat == flat.min()), flat.size)
        details_["implicit"] = "position_ids restarting at their lowest value"
        return _packed(seen, cu, cu, causal, sides(int(np.diff(cu).max())), q_len, k_len)
    left, right = sides(k_len)
    if mask is None:
        details_["implicit"] = "is_causal and sliding_window"
        _, _, lo, hi = aligned([q_len], [k_len], causal, left, right)
        seen.intervals = rows_intervals(np.arange(q_len), lo, hi, 1, q_len, k_len)
        return seen
    details_["implicit"] = "the 2-D padding mask, unpadded"
    seen.intervals, seen.planes = _unpadded(mask.detach().bool().cpu().numpy(), q_len, causal, left, right), (batch, 1)
    return seen


def _packed(seen: Seen, cu_q, cu_k, causal: bool, sides: tuple[int, int], q_len: int, k_len: int) -> Seen:
    """Batch rows flattened into one axis of packed sequences, as HF's flash path hands them to flash_attn_varlen_func."""
    cu_q, cu_k = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    sequence, row, lo, hi = aligned(np.diff(cu_q), np.diff(cu_k), causal, *sides)
    seen.intervals = rows_intervals(cu_q[:-1][sequence] + row, lo + cu_k[:-1][sequence], hi + cu_k[:-1][sequence], 1, q_len, k_len)
    seen.shape = (1, seen.shape[1], q_len, k_len)
    seen.details.update(cu_seq_lens_q=short(torch.from_numpy(cu_q)), cu_seq_lens_k=short(torch.from_numpy(cu_k)))
    return seen


def _packed_positions(positions: torch.Tensor, batch: int) -> bool:
    """HF's _is_packed_sequence: one batch row whose position ids are not one run counting up from their lowest."""
    if batch != 1 or positions.shape[-1] == 1:
        return False
    flat = positions.reshape(-1)
    return bool((torch.arange(flat.numel(), device=flat.device) + flat.min() != flat).any())


def _unpadded(valid: np.ndarray, q_len: int, causal: bool, left: int, right: int) -> Intervals:
    """HF's _upad_input: each batch row's real keys (and its real queries: the same mask where Lq = Lk, every query
    where Lq = 1, else the mask's last Lq columns) attend as one sequence, bottom-right aligned; back in padded
    places, a real query sees the real keys of its range, a padding query none."""
    batch, k_len = valid.shape
    queries = valid if q_len == k_len else np.ones((batch, 1), bool) if q_len == 1 else valid[:, -q_len:]
    sequence, row, lo, hi = aligned(queries.sum(1), valid.sum(1), causal, left, right)
    q_rows = np.nonzero(queries)[1]  # the padded place of each real query, batch row by batch row (row-major)
    # the runs of real keys of each batch row: [start, end) in padded places, and where each starts among the real ones
    edges = np.diff(np.pad(valid.astype(np.int8), ((0, 0), (1, 1))), axis=1)
    run_b, run_start = np.nonzero(edges == 1)
    run_end = np.nonzero(edges == -1)[1]
    counts = np.bincount(run_b, minlength=batch)
    first_run = np.cumsum(counts) - counts
    lengths = run_end - run_start
    before = np.cumsum(lengths) - lengths  # real keys before each run, over all rows: less those of earlier rows
    rank = before - before[first_run[run_b]] if len(run_b) else before
    # every (query, run of its batch row) pair: the query's [lo, hi) among real keys cut to the run, moved to padded places
    per_query = counts[sequence]
    pair_q = np.repeat(np.arange(len(sequence)), per_query)
    pair_run = np.repeat(first_run[sequence], per_query) + (np.arange(len(pair_q)) - np.repeat(np.cumsum(per_query) - per_query, per_query))
    s = np.maximum(lo[pair_q], rank[pair_run])
    e = np.minimum(hi[pair_q], rank[pair_run] + lengths[pair_run])
    keep = s < e
    shift = run_start[pair_run] - rank[pair_run]
    rows = sequence[pair_q] * q_len + q_rows[pair_q]
    starts, ends = by_row(rows[keep], (s + shift)[keep], (e + shift)[keep], batch * q_len, k_len)
    return Intervals.of(starts.reshape(batch, q_len, -1), ends.reshape(batch, q_len, -1), 0, k_len)


read.api = "hf"
