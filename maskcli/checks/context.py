"""What the rules read: the calls of a run, each with the model call that made it (its config and arguments).

A trace records, besides each attention call, every outermost module call (a model's forward, once per generate step):
its `config`, the 2-D arguments that say where tokens are (attention_mask, position_ids, cache_position, token_type_ids,
cu_seq_lens_q/k, cu_seqlens, seq_idx) as small numpy arrays, and its attention calls ([first, end) of their indices),
read as transformers reads them; nothing here imports torch or transformers.
"""

from __future__ import annotations

import bisect
import functools
import re
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from maskcli import tracefile
from maskcli.keypadding import read as found_padding  # noqa: F401 - key padding read off a mask: the one rule (maskcli.keypadding)
from maskcli.checks.placing import STARTS, queries, real_queries  # noqa: F401 - where queries sit (placing.py), asked of context

DENSE_CELLS = 1 << 22  # masks checked cell by cell up to this many cells (b*h*Lq*Lk as stored)
LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass
class Top:
    """One call of an outermost module: its name, its config (or None), its arguments, the attention calls it made."""

    where: str
    config: object = None
    arguments: dict = field(default_factory=dict)  # name -> np.ndarray (2-D int/bool tensors) or a short word
    first: int = 0
    end: int = 0
    stated: tuple = ()  # maskcli.checks.intent.Stated: the configs the program states its attention in (trace/stated.py)
    convs: tuple = ()  # what the call's time-mixing convolutions read of its padded frames (trace/convpad.py)
    pools: tuple = ()  # the positions each of its attention poolings weighs (trace/poolweights.py: pooledpad.py)
    permuted: tuple = ()  # its tokens reordered in each row by a gather (trace/permuted.py: checks/permuted.py)
    rows: tuple = ()  # (name, one hash per row of its first axis) of each small tensor argument (trace/samplerows.py)
    state_writes: int | None = None  # module state assigned before the call began (trace/assigned.py: continued.py)
    pooled: list = field(default_factory=list)  # rows and positions its output was read at (trace/poolrows.py: pooledat.py)
    rewritten: tuple = ()  # batch masks an earlier call's forward rewrote, begun with (trace/rewritten.py: rewritten.py)
    shapes: tuple = ()  # (name, shape) of each tensor argument of 2 axes or more (trace/handedshapes.py: restarted.py)
    loss_counted: tuple = ()  # bool targets each loss of the call counts, as they lie (trace/losses.py: emptytrained.py)


@dataclass
class Run:
    calls: list  # of trace Calls: .index .where .step .api .shape .details .stored
    tops: list[Top] = field(default_factory=list)
    cross: list = field(default_factory=list)  # cross-attention calls (engine.py sets them apart: no query sits among their keys)
    unmasked: list = field(default_factory=list)  # softmax calls of sites that mask nowhere (engine.py; held.py reads them)
    reweighed: list = field(default_factory=list)  # softmaxes over an earlier one's weights (engine.py; weighted.py)

    def top(self, call) -> Top | None:
        """The innermost outermost-module call that made `call` (the last begun before it, on the call's own thread where
        the program's threads make model calls of their own), from an index built once per run (asked of every call)"""
        index = self.__dict__.get("_tops")
        if index is None or index[0] is not self.tops or index[1] != len(self.tops):
            found: dict = {}  # thread (None: main, "*": any) -> call index -> top; a later one that began first overwrites
            for top in self.tops:
                for thread in ("*", top.arguments.get("thread")):
                    found.setdefault(thread, {}).update(dict.fromkeys(range(top.first, top.end), top))
            one = found.get("*", {}) if set(found) <= {"*", None} else None  # (every model call on the main thread)
            index = self.__dict__["_tops"] = (self.tops, len(self.tops), found, one)  # (self.tops held: its id its own)
        own = index[3] if index[3] is not None else index[2].get(getattr(call, "details", {}).get("thread"), {})
        return own[call.index] if call.index in own else index[2].get("*", {}).get(call.index)

    def made_by(self, top: Top) -> list:
        """The calls of `top` ([top.first, top.end) of the call indices, its inner model calls' too; on its own thread),
        in order. Not a slice of run.calls at those indices: engine.py's Run leaves out the cross-attention calls and
        the softmaxes of sites that mask nowhere (calls are kept in index order: found by bisection)."""
        calls, thread = self.calls, top.arguments.get("thread")
        first = bisect.bisect_left(calls, top.first, key=lambda call: call.index)
        found = calls[first:bisect.bisect_left(calls, top.end, first, key=lambda call: call.index)]
        return [call for call in found if getattr(call, "details", {}).get("thread") == thread]

    def placed(self, call) -> tuple[Top | None, np.ndarray, bool]:
        """(run.top(call), queries(call, top) read-only, columns_are_positions(call, top)), found once per call for
        every rule that places a call's queries among its keys."""
        memo = self.__dict__.setdefault("_placed", {})
        held = memo.get(id(call))
        if held is not None and held[0] is call:
            return held[1]
        top = self.top(call)
        q_len, k_len = call.shape[2:]
        given = call.details.get("queries")
        # (what queries() reads: the layers of one step share their placing)
        key = (id(top), q_len, k_len, None if given is None else (int(given[0]), int(given[1])))
        own = memo.get(key)
        if own is None:
            own = memo[key] = queries(call, top)  # (read-only: shared by every rule that asks)
        found = memo[id(call)] = (call, (top, own, columns_are_positions(call, top, own)))
        return found[1]

    def config(self, call):
        top = self.top(call)
        return None if top is None else top.config

    def sites(self) -> dict[str, list]:
        """Each call site's calls in step order (one dict for every rule that asks: read it, never change it)."""
        return self._by("sites", lambda call: call.where)

    def callers(self) -> dict[tuple, list]:
        """Each call site's calls by the line that called it where it is a function's line (trace/sites.py): a helper
        that the encoder and the decoder share is two, one full and one causal."""
        return self._by("callers", lambda call: (call.where, call.details.get("caller")))

    def _by(self, name: str, key) -> dict:
        held = self.__dict__.setdefault("_by_key", {}).get(name)
        if held is not None and held[0] == (id(self.calls), len(self.calls)):
            return held[1]
        found: dict = {}
        for call in self.calls:
            if call.stored is not None:
                found.setdefault(key(call), []).append(call)
        self.__dict__["_by_key"][name] = ((id(self.calls), len(self.calls)), found)
        return found


def masked_somewhere(call) -> bool:
    """False for a softmax that masked no cell: a router's or a classifier's as much as an attention's; the rules read
    only the call sites that mask somewhere (an MoE router's softmax is over experts, not keys), or whose module states
    itself causal (`self.causal = True`, or a class named `CausalSelfAttention`: its softmax is attention, masked or
    not), or whose function was handed an attention mask over its cells that it never applied (trace/given.py)."""
    found = call.details
    return call.api != "softmax" or bool(found.get("fill") or found.get("fill_value") is not None or found.get("additive")
                                         or found.get("bool_added")  # (a bool mask added to the scores: dtypes.py)
                                         or found.get("module_causal")  # (a module that says it is causal: own.py;
                                         or "att" in found.get("class_causal", "").lower()  # `CausalAttention`)
                                         or found.get("dropped_mask"))  # (handed an attention mask: trace/given.py)


CROSS_WORDS = re.compile(r"encoder_?attn|encdecattention|cross_?attn|cross_?attention|crossattention|multihead_attn|src_attn"
                         r"|cross_?atts?(?![a-z])|src_?(?:trg|tgt)_?att"  # (`cross_atts`: bert4keras; JoeyNMT's `src_trg_att`)
                         r"|enc_?dec_?att(?:n|ention)|encoder_decoder_attention|context_attn|dec[\w.]*[._]enc_?attn(?![a-z])"
                         r"|(?<![a-z0-9])x_?att(?:n|ention)", re.IGNORECASE)  # (Flamingo's `gated_xattn`; not flex_attn)


class Crossing(NamedTuple):
    """Whether a call's keys are another sequence's (a cross-attention), what says so (`by`), and the program's own
    words for it (`source`, shown in findings)."""

    cross: bool
    by: str
    source: str


STRONG = ("said", "memory", "scores")  # a module's word, a memory argument, one query's scores: nothing overrides them


def crossing(call) -> Crossing:
    """The one reading of whether `call` attends from one sequence to another (a decoder's queries to its encoder's
    memory): its keys are not the queries' own positions, so no rule may place its queries among them (bottom-right or
    otherwise). Trace reads what the program states once per call site (trace/crossing.py: a module's
    `is_cross_attention` / `attention_type`, a memory argument holding another tensor than the queries', the attending
    module's class); here it meets what the call itself shows, strongest first:

    - placed by maskcli's `model`, or keys read off the queries' own storage (one projection of one input, MHA(x, x, x):
      trace/masks.py's kv_source): self;
    - the module's word, a memory argument (or its None: self), one query's scores against a memory: as they say;
    - keys that grew by each step's queries (a cache), or MHA keys that end with its queries: self;
    - a module method's `kv` argument holding another tensor (it might have been the cache above): cross; the
      attending layer's forward handed `key` another tensor than its `query`, of other values: cross, the same values
      (or ending with them): self;
    - MHA handed another tensor as its keys, as many or not as its queries: cross where their lengths differ;
    - the module path (BART / Whisper `encoder_attn`, T5 `EncDecAttention`, `cross_attn`, BERT's `crossattention`,
      nn.TransformerDecoderLayer's `multihead_attn`, `src_attn`, JoeyNMT's `src_trg_att`, Flamingo's `xattn`) or the
      class name: cross, whatever the lengths (a Perceiver's latents may be as many as its frames);
    - more queries than keys where the kernel itself does not place them (a self-attention's keys hold its queries'
      own): cross. Equal lengths alone say nothing either way."""
    read = call.details.get("cross")
    now = (len(call.details), len(read) if isinstance(read, dict) else -1)  # (a site's shared reading gains "grows")
    held = _CROSSING.get(id(call))
    if held is not None and held[0] is call and held[1] == now:
        return held[2]  # (every rule asks it of every call: read once while the call's details stay as they are)
    if len(_CROSSING) > 1 << 16:
        _CROSSING.clear()
    found = _crossing(call)
    _CROSSING[id(call)] = (call, now, found)  # (the call held: its id cannot be reused while here)
    return found


_CROSSING: dict[int, tuple] = {}


def _crossing(call) -> Crossing:
    details = call.details
    q_len, k_len = call.shape[2:]
    if details.get("queries") is not None:
        return Crossing(False, "placed", "its queries placed by maskcli model")
    if details.get("kv_source") == "query":
        return Crossing(False, "own-keys", "its keys read off the queries' own projection")
    read = details.get("cross")
    if not isinstance(read, dict):
        read = {}
    if read.get("by") in STRONG:
        return Crossing(bool(read.get("cross")), read["by"], str(read.get("source")))
    if read.get("grows") or details.get("kv_source") == "cache":
        return Crossing(False, "cache", "its keys grew by each step's queries (a cache)" if read.get("grows")
                        else "its key input ends with its query input (a cache)")
    if read.get("by") in ("kv", "inputs"):
        return Crossing(bool(read.get("cross")), read["by"], str(read.get("source")))
    if details.get("kv_source") == "other" and q_len != k_len:
        return Crossing(True, "keys-input", f"keys from another input than its queries ({k_len} keys, {q_len} queries)")
    where = getattr(call, "where", "") or ""
    if _cross_word(where):
        return Crossing(True, "path", f"module path {where}")
    if read.get("by") == "class":
        return Crossing(True, "class", str(read.get("source")))
    if q_len > k_len and not (call.api in ("flash", "hf") and details.get("causal")):  # (flash places them itself)
        return Crossing(True, "shape", f"more queries ({q_len}) than keys ({k_len})")
    return Crossing(False, "none", "")


def cross(call) -> bool:
    """crossing(call).cross: the call's keys are another sequence's."""
    return crossing(call).cross


def _block(where: str) -> str:
    """The module path of a call's block: up to its first layer number (`layers.0`, `decoder.block.3`), else its parent."""
    parts = (where or "").split(".")
    number = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[:number + 1] if number is not None else parts[:-1])


def beside_memory(run, call, real: np.ndarray) -> bool:
    """`call` is a self-attention in the block of a cross-attention of the same model call whose keys begin with exactly
    the keys `real` (bool (B, L) real tokens) calls real, row by row: that padding is the cross-attention's memory's (a
    Perceiver's media frames, an encoder's source, SAM3's text joined before its box prompts), and `call` attends over
    the cross-attention's queries (the latents, the decoder's tokens), which it says nothing of, whatever their number."""
    if not run.cross or not real.any() or real.all():
        return False
    block = _block(call.where)
    for other in run.cross:
        if other.shape[2] != call.shape[2] or other.shape[3] < real.shape[1] or _block(other.where) != block \
                or run.top(other) is not run.top(call):
            continue
        cells = keep(other)
        if cells is None or cells.shape[0] not in (1, real.shape[0]):
            continue
        seen = np.broadcast_to(cells.any(axis=(1, 2))[:, :real.shape[1]], real.shape)
        if np.array_equal(seen, np.broadcast_to(real, real.shape)):
            return True
    return False


def layer(call) -> int | None:
    """The call's layer: what `model` placed, HF's layer_idx, else the last whole number of its module path."""
    if call.details.get("layer") is not None:
        return int(call.details["layer"])
    hf = call.details.get("hf")
    if isinstance(hf, dict) and isinstance(hf.get("layer_idx"), int):
        return hf["layer_idx"]
    return _layer_number(call.where or "")


@functools.lru_cache(maxsize=4096)
def _layer_number(where: str) -> int | None:
    """The last whole number of a module path (a run asks it of every call; a model has few paths)."""
    found = LAYER.findall(where)
    return int(found[-1]) if found else None


@functools.lru_cache(maxsize=4096)
def _cross_word(where: str) -> bool:  # (a file's name, a call named by its `file.py:LINE`, is no module's path)
    return CROSS_WORDS.search(re.sub(r"\S*\.py:\d+", "", where)) is not None


def keep(call) -> np.ndarray | None:
    """Bool (b, h, Lq, Lk) as stored (batch rows or heads that repeat kept once); None where not kept or too big, or
    where it is not what the kernel masked (a score_mod maskcli could not read: trace/flex.py).
    (A GPT-OSS sink column is left out of the stored mask already: trace.interface.leave_out_sink.)"""
    stored = call.stored
    if stored is None or stored.get("form") == "stats" or str(call.details.get("score_mod_read", "")).startswith("not"):
        return None
    b, h = stored["planes"]
    if b * h * call.shape[2] * call.shape[3] > DENSE_CELLS:
        return None
    held = _DENSE.get(id(stored))
    if held is not None and held[0] is stored:  # the rules read one stored mask many times: built once, read-only
        return held[1]
    cells = _dense(stored)
    cells.setflags(write=False)
    global _held
    while _DENSE and _held + cells.nbytes > _HELD_BYTES:
        _held -= _DENSE.pop(next(iter(_DENSE)))[1].nbytes  # the oldest first
    _DENSE[id(stored)] = (stored, cells)  # (the stored dict held too: its id cannot be reused while here)
    _held += cells.nbytes  # (a running total: summing every held mask on each insert cost more than the masks)
    return cells


_HELD_BYTES = 64 << 20
_DENSE: dict[int, tuple[dict, np.ndarray]] = {}
_held = 0  # bytes in _DENSE


def one_run_a_row(stored: dict | None) -> bool:
    """The stored mask keeps one interval of keys a row (trace's intervals form, one interval a row)."""
    return stored is not None and stored.get("form") == "intervals" and np.shape(stored["starts"])[-1] == 1


def runs(stored: dict | None, k_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(starts, ends) (b, h, Lq or 1) of a stored mask of one interval a row, clipped to the keys (an empty run: its end
    at its start), read without a pass over the cells; None for any other form."""
    if not one_run_a_row(stored):
        return None
    b, h = stored["planes"]
    starts = np.minimum(np.maximum(np.asarray(stored["starts"])[..., 0], 0), k_len)  # (np.clip costs three times this)
    ends = np.maximum(np.minimum(np.asarray(stored["ends"])[..., 0], k_len), starts)
    per = starts.shape[-1]  # (Lq, or 1 for every query; named: a batch of 0 rows has no -1 to reshape by)
    return starts.reshape(b, h, per), ends.reshape(b, h, per)


def _dense(stored: dict) -> np.ndarray:
    """tracefile.dense of a mask keep() reads (at most DENSE_CELLS cells, so no free-memory check): every plane in one
    pass per interval column, not a pass per plane (the rules read every stored mask of a run)."""
    if stored["form"] != "intervals":
        return tracefile.dense(stored)
    b, h = stored["planes"]
    q_len, k_len = stored["shape"][2:]
    starts, ends = np.asarray(stored["starts"]), np.asarray(stored["ends"])  # (b*h, Lq or 1, K)
    keys = np.arange(k_len)
    if starts.shape[2] == 1:  # (one interval a row, most masks: no pass to OR it into)
        cells = (keys >= starts) & (keys < ends)
        return np.broadcast_to(cells, (b * h, q_len, k_len)).reshape(b, h, q_len, k_len).copy() \
            if cells.shape[1] != q_len else cells.reshape(b, h, q_len, k_len)
    cells = np.zeros((b * h, q_len, k_len), dtype=bool)
    for k in range(starts.shape[2]):  # (K is small: a pass per interval column, as Intervals.dense)
        cells |= (keys >= starts[:, :, k, None]) & (keys < ends[:, :, k, None])
    return cells.reshape(b, h, q_len, k_len)


def columns_are_positions(call, top: Top | None, own: np.ndarray | None = None) -> bool:
    """Key column j is position j: a cache that keeps every key from position 0 (dynamic, static, or none); never a
    cross-attention's, whose keys are another sequence's. (`own`: queries(call, top) where the caller has it.)"""
    if call.details.get("slots") is not None or cross(call):
        return False
    placed = call.details.get("keys")
    if placed is not None:
        return placed[0] == 0
    own = queries(call, top) if own is None else own
    return own.size == 0 or int(own[-1]) < call.shape[3]  # (attention over no token: nothing to place)


def equals(cells: np.ndarray, expression: str, **placed) -> bool:
    """The cells are exactly `expression` placed as `placed` says (maskcli.testing.against); False where it cannot
    be placed so."""
    from maskcli.errors import MaskError
    from maskcli.testing import against

    key = (id(cells), expression, tuple(sorted(placed.items())))
    held = _EQUALS.get(key)
    if held is not None and held[0]() is cells:  # several rules ask the same of one call's cells
        return held[1]
    try:
        same = against(cells, expression, **placed).equal
    except MaskError:
        same = False
    if len(_EQUALS) >= 4096:
        _EQUALS.pop(next(iter(_EQUALS)))
    _EQUALS[key] = (weakref.ref(cells), same)  # (a weak reference: the answer goes with the cells)
    return same


_EQUALS: dict[tuple, tuple[weakref.ref, bool]] = {}


def triu(cells: np.ndarray, k: int = 0) -> np.ndarray:
    """np.triu(cells, k) on the last two axes (the cells of key j - query i >= k), by a band made once per shape:
    np.triu builds its band at every call, twenty times the cost of the AND on a (2, 128, 128) mask."""
    return cells & band(cells.shape[-2], cells.shape[-1], k, True)


def tril(cells: np.ndarray, k: int = 0) -> np.ndarray:
    """np.tril(cells, k) on the last two axes (key j - query i <= k), as triu."""
    return cells & band(cells.shape[-2], cells.shape[-1], k, False)


def band(q_len: int, k_len: int, k: int, upper: bool) -> np.ndarray:
    """Bool (q_len, k_len), read-only: j - i >= k (upper) or j - i <= k; kept for shapes up to DENSE_CELLS cells."""
    if q_len * k_len > DENSE_CELLS:
        return _band.__wrapped__(q_len, k_len, k, upper)
    return _band(q_len, k_len, k, upper)


@functools.lru_cache(maxsize=32)
def _band(q_len: int, k_len: int, k: int, upper: bool) -> np.ndarray:
    offset = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
    found = offset >= k if upper else offset <= k
    found.setflags(write=False)
    return found


def first_cell(cells: np.ndarray) -> tuple[int, ...]:
    """The first True of a bool array, as ints."""
    return tuple(int(x) for x in np.argwhere(cells)[0])
