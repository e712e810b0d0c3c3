"""The per-request query and key lengths an engine's metadata object states at an attention call.

Inference engines hand their attention a metadata object (a dataclass, a SimpleNamespace, a state class of their own)
that states, per request of the batch, how many new tokens it brings and how many keys it attends over: vLLM's and
xLLM's `AttentionMetadata.seq_lens` / `kv_seq_lens` beside `query_start_loc` / `q_cu_seq_lens`, LightLLM's
`b_seq_len` / `b_att_seq_len` beside `b1_cu_q_seq_len` / `cu_seqlens_q`, flash-attention's `cu_seqlens_k`. Read at
each call from the objects the program's own frames hold (a frame's `self` or a local, and one object level under
them: `self.infer_state`), never from the frame's plain variables, which are the kernel's own arguments (what is
checked, not what states). Only objects of classes the program defines (not a library's config or cache) and
SimpleNamespaces. checks/reqlens.py holds each request's call against them.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types

import torch

from maskcli.trace.codes import ByCode

# total keys per request (the new tokens included), as engines name them; `context_lens` and `cache_seqlens` are left
# out: several engines count the cached tokens alone under them (flash_attn_with_kvcache appends `k` after them)
KEYS = frozenset(("kv_seq_lens", "kv_seq_lens_host", "kv_lens", "kv_seq_len", "kv_seqlens", "seq_lens", "seq_lens_tensor",
                  "b_seq_len", "b_att_seq_len", "seqused_k", "seqlens_k", "b_kv_seq_len"))
KEYS_CUMULATIVE = frozenset(("cu_seqlens_k", "cu_seq_lens_k", "cu_seqlens_kv", "kv_cu_seq_lens", "cu_kv_seq_lens",
                             "b1_cu_kv_seq_len"))
QUERIES = frozenset(("q_seq_lens", "query_lens", "q_lens", "b_q_seq_len", "query_seq_lens", "q_seq_len",
                     "extend_seq_lens"))  # (SGLang's: the new tokens of each request)
QUERIES_CUMULATIVE = frozenset(("cu_seqlens_q", "cu_seq_lens_q", "q_cu_seq_lens", "query_start_loc", "b1_cu_q_seq_len",
                                "cu_q_seq_lens"))
# a window of keys a request's attention may keep to (fewer keys than the request has: a rolling buffer)
WINDOWS = frozenset(("sliding_window", "window_size", "sliding_window_size", "window_left", "attention_window",
                     "local_window_size", "attention_chunk_size", "window"))
NAMES = KEYS | KEYS_CUMULATIVE | QUERIES | QUERIES_CUMULATIVE
MOST = 4096  # requests of one batch read at most
_CODES = ByCode()  # code object -> whether it is the program's own
_OWN: dict[type, bool] = {}
_TENSORS: dict[int, tuple] = {}  # id(tensor) -> (tensor, version, its ints)  # class -> whether its objects are read (the program's own classes, SimpleNamespace)


def lengths(frames: list) -> dict | None:
    """{"queries": (source, [per request]), "keys": (source, [per request])} stated by the objects the program's frames
    hold (`frames`: (frame, names) innermost first, as trace/walk.py hands held.py its frames); None where either is
    unstated, or the key lengths of as many requests as the query lengths disagree."""
    queries, keys, seen = [], [], set()
    frames = [(frame, names) for frame, names in frames if _own(frame.f_code)]  # (a module's top level: no call's)
    for frame, _ in frames:
        where = None
        for variable, value in list(frame.f_locals.items()):
            if id(value) in seen or not _read(value):
                continue
            where = where or _where(frame)
            seen.add(id(value))
            _fields(value, variable, where, queries, keys)
            for name, inner in list(_attributes(value).items()):
                if id(inner) not in seen and type(name) is str and not name.startswith("__") and _read(inner):
                    seen.add(id(inner))
                    _fields(inner, f"{variable}.{name}", where, queries, keys)
    if not queries or not keys:
        return None
    count = {len(q) for _, q in queries}
    if len(count) != 1 or len({tuple(q) for _, q in queries}) != 1 or min(queries[0][1]) < 0:
        return None  # (two query statements that differ: nothing says which the call is; a negative count is none)
    said = queries[0][1]  # (keys count the new tokens too: fewer keys than queries, or a negative count, state nothing)
    matching = [(source, k) for source, k in keys if len(k) == len(said) and all(a >= b for a, b in zip(k, said))]
    if not matching or len({tuple(k) for _, k in matching}) != 1:
        return None
    window = next((said for frame, _ in frames for variable, value in list(frame.f_locals.items())
                   if (said := _window(variable, value, frame)) is not None), None)
    return {"queries": queries[0], "keys": matching[0], "besides": [s for s, _ in matching[1:]], "window": window}


def _where(frame) -> str:
    return f"{frame.f_code.co_name}() of {os.path.basename(frame.f_code.co_filename)}"


def _window(variable: str, value, frame) -> str | None:
    """Where a frame's variable, or an attribute of the module or program object it holds (a layer's
    `self.sliding_window`), states a window of some keys (an int above 0, or a pair with one): such a request may be
    handed fewer keys."""
    if variable in WINDOWS and _positive(value):
        return f"{variable}={value!r} (in {_where(frame)})"
    if not issubclass(type(value), torch.nn.Module) and not _read(value):
        return None
    held = _attributes(value)
    for name in WINDOWS.intersection(held):
        if _positive(held[name]):
            return f"{variable}.{name}={held[name]!r} (in {_where(frame)})"
    return None


def _positive(value) -> bool:
    if type(value) in (tuple, list):
        return any(type(x) is int and x > 0 for x in value)
    return type(value) is int and value > 0


def _own(code) -> bool:
    """The code is a function of the program's own (not an installed package's: a transformers model's frames state no
    engine's metadata, and reading their variables at every call would cost the trace; nor a module's top level, whose
    variables speak for no one call)."""
    own = _CODES.get(code)
    if own is None:
        own = _CODES.put(code, not code.co_filename.startswith(_libraries()) and code.co_name != "<module>")
    return own


def _read(value) -> bool:
    """Whether `value` is an object whose fields are read: of a class the program defines, or a SimpleNamespace."""
    kind = type(value)
    try:
        own = _OWN.get(kind)
        if own is None:
            own = _OWN[kind] = _program_class(kind)
    except (Exception, SystemExit):  # noqa: BLE001 - a class whose metaclass raises (its hash, dir, __module__): not read
        return False
    return own


def _program_class(kind: type) -> bool:
    if kind is types.SimpleNamespace:
        return True
    if issubclass(kind, (torch.nn.Module, torch.Tensor, type, BaseException)) or "__dict__" not in dir(kind):
        return False
    name = getattr(sys.modules.get(kind.__module__), "__file__", None) or ""
    return bool(name) and not name.startswith(_libraries())


@functools.cache
def _libraries() -> tuple[str, ...]:
    """torch's, maskcli's, the standard library's and installed packages': not the program's classes."""
    from maskcli.trace.held import _skipped

    return (*_skipped(), *(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))


def _fields(value, variable: str, where: str, queries: list, keys: list) -> None:
    """The length fields of one object, appended to `queries` / `keys` as (source, per-request ints)."""
    held = _attributes(value)
    for name in NAMES.intersection(held):
        try:
            rows = _ints(held[name])
        except (Exception, SystemExit):  # noqa: BLE001 - a value that raises as it is read (a list subclass's len): states nothing
            continue
        if rows is None:
            continue
        cumulative = name in KEYS_CUMULATIVE or name in QUERIES_CUMULATIVE
        if cumulative:
            if len(rows) < 2 or rows[0] != 0 or any(b < a for a, b in zip(rows, rows[1:])):
                continue  # (a start-location list without its leading 0 is not one)
            rows = [b - a for a, b in zip(rows, rows[1:])]
        if not rows:
            continue
        source = f"{variable}.{name} ({type(value).__name__}, in {where})"
        (queries if name in QUERIES or name in QUERIES_CUMULATIVE else keys).append((source, rows))


def _attributes(value) -> dict:
    """The object's own attributes; {} where its `__dict__` raises or is no dict (a property of the program's)."""
    try:
        held = vars(value)
    except (Exception, SystemExit):  # noqa: BLE001 - the program's object shows nothing here
        return {}
    return held if type(held) is dict else {}


def _ints(value) -> list[int] | None:
    """A 1-D integer tensor or a list of ints, as a list; None for anything else."""
    if issubclass(type(value), torch.Tensor):
        if value.dim() != 1 or value.layout != torch.strided or value.is_floating_point() or value.dtype == torch.bool \
                or not 0 < value.numel() <= MOST or value.device.type == "meta":
            return None
        if not value.is_inference():  # (read once while unchanged: the same metadata at every layer's call)
            held = _TENSORS.get(id(value))
            if held is not None and held[0] is value and held[1] == value._version:
                return held[2]
        rows = [int(x) for x in value.detach().cpu().tolist()]
        if not value.is_inference():
            if len(_TENSORS) > 64:
                _TENSORS.pop(next(iter(_TENSORS)))
            _TENSORS[id(value)] = (value, value._version, rows)  # (the tensor held: its id stays its own)
        return rows
    if issubclass(type(value), (list, tuple)) and 0 < len(value) <= MOST and all(type(x) is int for x in value):
        return list(value)
    return None
