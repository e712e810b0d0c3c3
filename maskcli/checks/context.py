"""What the rules read: the calls of a run, each with the model call that made it (its config and arguments).

A trace records, besides each attention call, every call of an outermost module (a model's forward,
once per generate step): the module's `config` where it has one, the 2-D arguments that say where
tokens are (attention_mask, position_ids, cache_position, token_type_ids, cu_seq_lens_q/k, cu_seqlens,
seq_idx) as small numpy arrays, and which attention calls it made ([first, end) of the call indices). The rules read
these as transformers reads them; nothing here imports torch or transformers.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

import numpy as np

from maskcli import tracefile
from maskcli.keypadding import read as found_padding  # noqa: F401 - key padding read off a mask: the one rule (maskcli.keypadding)

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


@dataclass
class Run:
    calls: list  # of trace Calls: .index .where .step .api .shape .details .stored
    tops: list[Top] = field(default_factory=list)
    cross: list = field(default_factory=list)  # cross-attention calls (engine.py sets them apart: no query sits among their keys)
    unmasked: list = field(default_factory=list)  # softmax calls of sites that mask nowhere (engine.py; held.py reads them)

    def top(self, call) -> Top | None:
        """The innermost outermost-module call that made `call` (the last one that began before it)."""
        found = None
        for top in self.tops:
            if top.first <= call.index < top.end:
                found = top
        return found

    def config(self, call):
        top = self.top(call)
        return None if top is None else top.config

    def sites(self) -> dict[str, list]:
        """Each call site's calls in step order."""
        return self._by(lambda call: call.where)

    def callers(self) -> dict[tuple, list]:
        """Each call site's calls by the line that called it where it is a function's line (trace/sites.py): a helper
        that the encoder and the decoder share is two, one full and one causal."""
        return self._by(lambda call: (call.where, call.details.get("caller")))

    def _by(self, key) -> dict:
        found: dict = {}
        for call in self.calls:
            if call.stored is not None:
                found.setdefault(key(call), []).append(call)
        return found


def masked_somewhere(call) -> bool:
    """False for a softmax that masked no cell: a router's or a classifier's as much as an attention's; the rules read
    only the call sites that mask somewhere (an MoE router's softmax is over experts, not keys), or whose module states
    itself causal (`self.causal = True`: its softmax is attention, masked or not)."""
    found = call.details
    return call.api != "softmax" or bool(found.get("fill") or found.get("fill_value") is not None or found.get("additive")
                                         or found.get("bool_added")  # (a bool mask added to the scores: dtypes.py)
                                         or found.get("module_causal"))  # (a module that says it is causal: own.py)


CROSS_WORDS = re.compile(r"encoder_?attn|encdecattention|cross_?attn|cross_?attention|crossattention|multihead_attn|src_attn"
                         r"|enc_?dec_?att(?:n|ention)|encoder_decoder_attention|context_attn", re.IGNORECASE)


def cross(call) -> bool:
    """The call attends from one sequence to another (a decoder's queries to its encoder's memory): its keys are not the
    queries' own positions, so no rule may place its queries among them (bottom-right or otherwise).

    Said by: the module path (BART / Whisper `encoder_attn`, T5 `EncDecAttention`, `cross_attn`, BERT's
    `crossattention`, nn.TransformerDecoderLayer's `multihead_attn`, the Annotated Transformer's `src_attn`), a memory
    handed to the function attending (`encoder_hidden_states`, `context`: trace/held.py kv_given) whose length the keys
    have (not a joint attention's, that concatenates it with the queries' own tokens), or more
    queries than keys where the kernel itself does not place them (a self-attention's keys hold its queries' own);
    never where the keys were read off the queries' own storage (one projection of one input: trace/masks.py)."""
    details = call.details
    if details.get("queries") is not None or details.get("kv_source") == "query":
        return False
    if details.get("cross_said") or details.get("kv_given") and call.shape[3] in details.get("kv_shape", ()) \
            or CROSS_WORDS.search(getattr(call, "where", "") or ""):  # (a module's own word: trace/held.py)
        return True
    q_len, k_len = call.shape[2:]
    return q_len > k_len and not (call.api in ("flash", "hf") and details.get("causal"))  # (flash places them itself)


def _block(where: str) -> str:
    """The module path of a call's block: up to its first layer number (`layers.0`, `decoder.block.3`), else its parent."""
    parts = (where or "").split(".")
    number = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[:number + 1] if number is not None else parts[:-1])


def beside_memory(run, call, real: np.ndarray) -> bool:
    """`call` is a self-attention in the block of a cross-attention of the same model call whose keys are exactly the
    keys `real` (bool (B, L) real tokens) calls real, row by row: that padding is the cross-attention's memory's (a
    Perceiver's media frames, an encoder's source), and `call` attends over the cross-attention's queries (the latents,
    the decoder's tokens), which it says nothing of, whatever their number."""
    if not run.cross or not real.any() or real.all():
        return False
    block = _block(call.where)
    for other in run.cross:
        if other.shape[2] != call.shape[2] or other.shape[3] != real.shape[1] or _block(other.where) != block \
                or run.top(other) is not run.top(call):
            continue
        cells = keep(other)
        if cells is None or cells.shape[0] not in (1, real.shape[0]):
            continue
        seen = np.broadcast_to(cells.any(axis=(1, 2)), real.shape)
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
    found = LAYER.findall(call.where or "")
    return int(found[-1]) if found else None


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
    cells = tracefile.dense(stored)
    cells.setflags(write=False)
    while _DENSE and sum(held[1].nbytes for held in _DENSE.values()) + cells.nbytes > _HELD_BYTES:
        _DENSE.pop(next(iter(_DENSE)))  # the oldest first
    _DENSE[id(stored)] = (stored, cells)  # (the stored dict held too: its id cannot be reused while here)
    return cells


_HELD_BYTES = 64 << 20
_DENSE: dict[int, tuple[dict, np.ndarray]] = {}


def queries(call, top: Top | None) -> np.ndarray:
    """The absolute position of each query row: `model`'s placing, the model call's cache_position or input_pos, the
    last tokens a static cache holds (its slots past them unwritten), its position_ids where every batch row counts
    up by 1 (the furthest row's: a left-padded row counts from its first real token; transformers' generate passes
    position_ids alone), else the end of the keys (a cache that keeps every key, the key columns being positions)."""
    q_len, k_len = call.shape[2:]
    placed = call.details.get("queries")
    if placed is not None:
        return np.arange(placed[0], placed[1])
    arguments = {} if top is None else top.arguments
    for name in ("cache_position", "input_pos"):
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim <= 2 and given.shape[-1] == q_len:
            return given.reshape(-1, q_len)[0].astype(np.int64)
    held = arguments.get("cache_length")
    if isinstance(held, int) and q_len <= held < k_len:  # a static cache's slots past the written ones (trace/tops.py)
        return np.arange(held - q_len, held)
    sizes = () if top is None else top.arguments.get("cache_slots", ())
    if isinstance(held, int) and any(held >= size and k_len == size - 1 + q_len for size in sizes):
        return np.arange(held - q_len, held)  # a full static sliding layer's last size - 1 keys and the new ones
        # (cache_utils.py StaticSlidingWindowLayer.update 583-591, 621-624): its columns are not positions
    given = arguments.get("position_ids")
    if isinstance(given, np.ndarray) and given.ndim <= 2 and given.shape[-1] == q_len:
        rows = given.reshape(-1, q_len)
        if (np.diff(rows, axis=1) == 1).all():
            return rows[int(rows[:, 0].argmax())].astype(np.int64)
    return np.arange(k_len - q_len, k_len)


def columns_are_positions(call, top: Top | None) -> bool:
    """Key column j is position j: a cache that keeps every key from position 0 (dynamic, static, or none); never a
    cross-attention's, whose keys are another sequence's."""
    if call.details.get("slots") is not None or cross(call):
        return False
    placed = call.details.get("keys")
    if placed is not None:
        return placed[0] == 0
    return int(queries(call, top)[-1]) < call.shape[3]


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


def first_cell(cells: np.ndarray) -> tuple[int, ...]:
    """The first True of a bool array, as ints."""
    return tuple(int(x) for x in np.argwhere(cells)[0])


