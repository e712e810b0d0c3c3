"""The mask each attention API applies, read from the arguments of one call, in keep form.

Each reader returns a Seen: the (B, H, Lq, Lk) shape the kernel applies after broadcasting, the q/k/v shapes, what
else the call said (is_causal, scale, ...) and the mask either as a bool torch tensor of 4 dimensions that broadcasts to
that shape, or as key intervals (is_causal, no mask, FlexAttention's blocks), so that no L x L tensor is made where the
program made none.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from maskcli import tracefile
from maskcli.inspect.polarity import additive_keep
from maskcli.trace.maskfacts import attention_bias as _attention_bias, empty_rows as _empty_rows, infinite as _infinite, \
    nan_scores as _nan_scores, note_zero_one, poison, query_offset, row_constant
from maskcli.trace.maskfacts import frozen as _frozen, tril as _tril
from maskcli.text import step_label
from maskcli.trace.given import gathered_keys, stored  # noqa: F401 - stored: with the mask its frames handed (capture.py)
from maskcli.trace.tables import watched  # noqa: F401 - readers of what the program states, not calls (capture.py)
from maskcli.trace.fillleak import fill_leak
from maskcli.trace.keyreads import key_reads
from maskcli.trace.shifted import hide
from maskcli.trace.finitefill import FILL_AT_MOST, finite_fill as _finite_fill  # noqa: F401 - (read from here too)
from maskcli.trace.queried import LOCAL, query_tensor
from maskcli.trace.regrouped import operands as regrouped
from maskcli.trace.tiled import one_sample
from maskcli.intervals import Intervals


@dataclass(slots=True)  # (slots: a million calls are a million records, each without a __dict__)
class Operands:
    """What an attention call computed on: its API, the (B, H, Lq, Lk) its mask applies at, q/k/v shapes, dtype, device."""

    api: str
    shape: tuple[int, int, int, int]
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: str
    device: str

    def operands(self) -> dict:
        """These fields by name, to make another record of the same call."""
        return {name: getattr(self, name) for name in Operands.__dataclass_fields__}


@dataclass
class Seen(Operands):
    """A call as a reader saw it: its operands and its mask (a keep tensor or key intervals)."""

    keep: torch.Tensor | None = None  # bool, 4-D, broadcasts to `shape`
    intervals: Intervals | None = None  # or: (b*h, Lq, K) key intervals over [0, Lk) (Lq may be 1: it broadcasts)
    planes: tuple[int, int] = (1, 1)  # (b, h) of the intervals: 1 where every batch row or head is the same
    details: dict = field(default_factory=dict)
    sources: tuple = ()  # the mask tensors the call was given: the same ones again are the same mask
    child: str | None = None  # the submodule that attends, where the call was read at its parent (an encoder layer)
    make: object = None  # or: what makes `keep` from `sources`, run only where they were not read already (capture's
    # cache: a model hands one mask to every layer); materialize() runs it
    made: dict = field(default_factory=dict)  # the details making `keep` added (a hit of the cache adds them again)

    def materialize(self) -> torch.Tensor | None:
        """`keep`, made now where a reader left it to `make`."""
        if self.make is not None:
            before = set(self.details)
            self.keep, self.make = self.make(), None
            self.made = {key: value for key, value in self.details.items() if key not in before}
        return self.keep


@dataclass(slots=True)
class Call(Operands):
    """One attention call: where it came from, what it computed on, its mask (a key into Trace.masks; capture.py)."""

    index: int = 0
    where: str = ""
    step: int = 0
    mask: str | None = None
    details: dict = field(default_factory=dict)
    trace: object = field(default=None, repr=False, compare=False)

    @property
    def stored(self) -> dict | None:
        masks = self.trace.masks  # (first: a placeholder key is replaced as the masks are read)
        return masks.get(self.mask) if self.mask is not None else None

    def keep(self) -> np.ndarray:
        """Bool (B, H, Lq, Lk), True = may attend (a read-only broadcast view where batch rows or heads repeat)."""
        return np.broadcast_to(tracefile.dense(self.stored), self.shape)

    def json(self) -> dict:
        return {"index": self.index, "where": self.where, "api": self.api, "step": self.step,
                "step_label": self.details.get("step_name") or step_label(self.step, self.shape[2]), "shape": list(self.shape),
                "q": list(self.q), "k": list(self.k), "v": list(self.v), "dtype": self.dtype, "device": self.device,
                "mask": self.mask, "details": {k: v for k, v in self.details.items() if k not in LOCAL}}


def _four(lead: tuple[int, ...]) -> tuple[int, int]:
    """(B, H) from the batch dimensions in front of (L, E): missing ones are 1, extra leading ones fold into B."""
    lead = tuple(lead)
    if len(lead) < 2:
        lead = (1,) * (2 - len(lead)) + lead
    return math.prod(lead[:-1]), lead[-1]


def _as_4d(tensor: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """A mask of any rank viewed as 4-D, its last two dimensions expanded to (Lq, Lk) (a view)."""
    if tensor.dim() < 4:
        tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))
    elif tensor.dim() > 4:
        tensor = tensor.reshape((-1,) + tuple(tensor.shape[-3:]))
    return tensor.expand(tensor.shape[0], tensor.shape[1], q_len, k_len)


@functools.lru_cache(maxsize=64)  # (one object for one shape: capture's cache knows it again; never changed in place)
def top_left_causal(q_len: int, k_len: int) -> Intervals:
    """SDPA's is_causal: query row i sees keys 0..i (torch.tril of an Lq x Lk matrix, aligned top-left)."""
    ends = np.minimum(np.arange(1, q_len + 1, dtype=np.int64), k_len)
    return _frozen(Intervals.of(np.zeros((1, q_len, 1), np.int64), ends.reshape(1, q_len, 1), 0, k_len))


@functools.lru_cache(maxsize=64)
def everything(q_len: int, k_len: int) -> Intervals:
    return _frozen(Intervals.of(np.zeros((1, 1, 1), np.int64), np.full((1, 1, 1), k_len, np.int64), 0, k_len))


def _keep(mask: torch.Tensor, details: dict | None = None) -> torch.Tensor:
    """Keep form of an SDPA-style mask: bool True = attend; a float mask adds, so -inf (or at most -1e4) masks.
    A float mask that also adds other values (ALiBi, relative positions) is noted in `details` as a bias (an integer
    one, which SDPA refuses, adds nothing)."""
    if mask.dtype == torch.bool:
        return mask
    keep = additive_keep(mask.detach())
    if details is not None:
        _empty_rows(keep, mask.detach() == float("-inf"), details)
        poison(mask.detach(), details)
    if details is not None and mask.is_floating_point() and bool((keep & (mask.detach() != 0)).any()):
        if not row_constant(mask.detach(), keep):  # (a shift of a whole row is no bias)
            details["bias"] = True
        note_zero_one(mask, details)  # a keep mask of 0s and 1s added as it is; not 1s alone, a constant (Doge's dt)
    return keep


def _dtype(tensor: torch.Tensor) -> str:
    return _dtype_name(tensor.dtype)


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:  # (one string per dtype: every call's record holds one or two)
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:  # (one string per device, made once)
    return str(device)


SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa(args: tuple, kwargs: dict) -> Seen:
    given = dict(zip(SDPA_NAMES, args))
    if kwargs:
        given.update(kwargs)
    q, k, v = given["query"], given["key"], given["value"]
    mask, is_causal = given.get("attn_mask"), bool(given.get("is_causal", False))
    q_shape, k_shape = tuple(q.shape), tuple(k.shape)  # (each shape read once: a tensor's attributes cost a call each)
    q_len, k_len = q_shape[-2], k_shape[-2]
    lead = q_shape[:-2]
    if _attention_bias(mask):
        mask = mask._materialize(q.device)  # (an attention-bias object, CausalBias: its (Lq, Lk) cells, as its dispatch runs)
    if mask is not None:
        mask_shape = tuple(mask.shape)
        if len(mask_shape) > 2:
            lead = _broadcast(lead, mask_shape[:-2])
    details = {"is_causal": is_causal, "scale": given.get("scale"), "enable_gqa": bool(given.get("enable_gqa", False)),
               "dropout_p": float(given.get("dropout_p", 0.0) or 0.0), **key_reads(q, k, v, k_shape, mask, is_causal),  # (K, V: zerokv.py, fillkv.py, slotwrites.py)
               "query_tensor": query_tensor(q) if q_len > 1 else None}  # (queries seen again: no chunk, checks/prefill.py)
    seen = Seen("sdpa", (*_four(lead), q_len, k_len), q_shape, k_shape, tuple(v.shape), _dtype(q), _device_name(q.device), details=details)
    gathered_keys(seen, k, mask is None and not is_causal, q, mask, is_causal)  # (keys a varlen path gathered, against its mask: gathered.py)
    details.update(regrouped(q, k, turned=False))  # (q or k viewed with heads before positions: trace/regrouped.py)
    if len(q_shape) == 3 and (part := one_sample(q, k)) is not None:  # (one sample's heads: its row, tiled.py)
        details["tile"] = part
    if _same_storage(q, k):
        details["kv_source"] = "query"  # one projection of one input (a fused qkv): self-attention (checks/context.crossing)
    if mask is not None:
        details["mask_dtype"] = _dtype(mask)
        if mask.is_floating_point():  # (a finite fill the scores outgrow: checks/fillleak.py)
            details.update(fill_leak(q, k, mask, details["scale"], details["enable_gqa"]))
        if q_len > 1 and not is_causal and (len(mask_shape) < 2 or mask_shape[-2] == 1):  # one row for every query: no query's own position
            details["mask_rows"] = 1
        seen.make = lambda: _as_4d(_keep(mask, details), q_len, k_len)  # (not where this mask was read already)
        seen.sources = (mask,)
        if is_causal:  # (documented to raise, yet torch keeps both, the mask and the top-left causal: nanoVLM's prefill)
            seen.make, seen.sources = lambda: _as_4d(_keep(mask, details), q_len, k_len) & _tril(q_len, k_len, mask), ()
    elif is_causal:
        seen.intervals = top_left_causal(q_len, k_len)
    else:
        seen.intervals = everything(q_len, k_len)
    return seen


def _broadcast(a: tuple, b: tuple) -> tuple:
    """torch.broadcast_shapes of two shapes (in plain Python: that one runs torch's reference code, tens of us a call)."""
    if len(a) < len(b):
        a, b = b, a
    b = (1,) * (len(a) - len(b)) + b
    if any(x != y and x != 1 and y != 1 for x, y in zip(a, b)):
        raise RuntimeError(f"shapes {a} and {b} do not broadcast")
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def _storage_start(tensor: torch.Tensor) -> int:
    return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both views of one storage (q, k split from one projection of one input); False where it cannot be read."""
    try:  # (each storage's start from the tensor's own pointer: untyped_storage() makes an object, ~0.3 ms under trace)
        return _storage_start(a) == _storage_start(b) != 0
    except (RuntimeError, NotImplementedError):  # (tensor subclasses, functional tensors: no storage to compare)
        return False


def _ends_with(k: torch.Tensor, q: torch.Tensor) -> bool:
    """MHA's (L, B, E) key input ends with its query input: past tokens before the queries' own (an incremental
    decoder's cache handed as the keys), a self-attention."""
    try:
        return k.dim() == q.dim() and k.shape[0] > q.shape[0] and k.shape[1:] == q.shape[1:] \
            and bool(torch.equal(k[k.shape[0] - q.shape[0]:], q))
    except (RuntimeError, NotImplementedError):  # (tensor subclasses: nothing to compare)
        return False


@functools.cache
def _mha_signature() -> inspect.Signature:
    return inspect.signature(F.multi_head_attention_forward)


def mha(args: tuple, kwargs: dict) -> Seen:
    """F.multi_head_attention_forward (what nn.MultiheadAttention calls): attn_mask and key_padding_mask merged as it
    merges them (either one masks a cell; block polarity for bool, additive for float), with the key bias_k and
    add_zero_attn add; is_causal replaces the mask only where MHA hands it to SDPA (no key_padding_mask, no weights)."""
    bound = _mha_signature().bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    q, k, v = a["query"], a["key"], a["value"]
    batched = q.dim() == 3
    q_len, batch = q.shape[0], (q.shape[1] if batched else 1)
    heads = int(a["num_heads"])
    k_len = a["static_k"].shape[1] if a["static_k"] is not None else k.shape[0]
    extra = int(a["bias_k"] is not None) + int(bool(a["add_zero_attn"]))
    k_len += extra
    attn_mask, padding = a["attn_mask"], a["key_padding_mask"]
    need_weights = bool(a["need_weights"])
    details = {"need_weights": need_weights, "is_causal": bool(a["is_causal"]), "num_heads": heads,
               "dropout_p": float(a["dropout_p"] or 0.0) if a["training"] else 0.0,
               "key_padding": {}}  # MHA has a key-padding argument: the padding is what it says (maskcli.keypadding)
    if k is q or _same_storage(q, k):
        details["kv_source"] = "query"  # self-attention: MHA(x, x, x) (checks/context.crossing)
        if (offset := query_offset(q, k)) is not None:  # (the queries a slice of the keys: x[:, T:] against x)
            details["query_offset"] = offset
    else:  # keys from another tensor: another sequence's, or a cache whose last keys are the queries' own tokens
        details["kv_source"] = "cache" if _ends_with(k, q) else "other"
    seen = Seen("mha", (batch, heads, q_len, k_len), tuple(q.shape), tuple(k.shape), tuple(v.shape), _dtype(q), str(q.device), details=details)
    if a["is_causal"] and padding is None and not need_weights:
        seen.intervals = top_left_causal(q_len, k_len)
        if attn_mask is not None:  # dropped for SDPA's is_causal: said where it is not that mask (checks/kernels.py)
            from maskcli.trace.maskfacts import dropped as _dropped

            dropped = _dropped(attn_mask, batch, heads, q_len, k_len - extra)
            if dropped is not None:
                details["dropped_attn_mask"] = dropped
        return seen
    keep = torch.ones((1, 1, q_len, k_len), dtype=torch.bool, device=q.device)
    if attn_mask is not None:  # bool: True = masked (MHA's polarity); float: added to the scores
        details["attn_mask_dtype"] = _dtype(attn_mask)
        own = ~attn_mask if attn_mask.dtype == torch.bool else additive_keep(attn_mask.detach())
        own = own.reshape(batch, heads, q_len, -1) if own.dim() == 3 else own.reshape(1, 1, q_len, -1)
        keep = _allow_extra(own, extra)
        note_zero_one(attn_mask, details)  # a float 0/1 mask MHA adds to the scores (SASRec.pytorch aab3261)
    if padding is not None:  # (N, S), or (S) unbatched: True = a padding key
        details["key_padding_mask_dtype"] = _dtype(padding)
        own = ~padding if padding.dtype == torch.bool else additive_keep(padding.detach())
        keep = keep & _allow_extra(own.reshape(batch, 1, 1, -1), extra)
        note_zero_one(padding, details, "key_padding_mask")  # (a float pad mask of 1s and 0s, added as it is)
        details["key_padding"] = _key_padding(_allow_extra(own.reshape(batch, 1, 1, -1), extra))
    if attn_mask is None and padding is None:
        from maskcli.trace.mhazero import mha_zero_kv  # (zero inputs under zero biases: zero K and V, trace/zerokv.py)

        details.update(mha_zero_kv(a))
        seen.intervals = everything(q_len, k_len)
    else:
        if any(x is not None and x.is_floating_point() for x in (attn_mask, padding)):
            _empty_rows(keep, _infinite(attn_mask, padding, batch, heads, q_len, extra), details)
        seen.keep = keep
        seen.sources = tuple(x for x in (attn_mask, padding) if x is not None)
    return seen


def _key_padding(real: torch.Tensor) -> dict:
    """The flags (--lengths, --pad left, --ids) of a key padding mask's real keys, (B, 1, 1, Lk); {} where none is padding."""
    from maskcli.keypadding import options

    real = real.reshape(real.shape[0], -1).cpu().numpy()
    return {} if real.all() else options(real)


def _allow_extra(keep: torch.Tensor, extra: int) -> torch.Tensor:
    """MHA pads its masks with allowed columns for bias_k and add_zero_attn's keys."""
    if not extra:
        return keep
    return torch.cat([keep, torch.ones(keep.shape[:-1] + (extra,), dtype=torch.bool, device=keep.device)], -1)


def softmax_input(args: tuple, kwargs: dict):
    return args[0] if args else kwargs.get("input", kwargs.get("self"))


def softmax(args: tuple, kwargs: dict) -> Seen | None:
    """A softmax over the last dimension of a 3-D or 4-D tensor: the scores of eager attention, masked where -inf or the
    dtype's lowest value (masked_fill and Hugging Face's eager path), or a finite fill (_finite_fill); else None."""
    x = softmax_input(args, kwargs)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3, 4, 5, 6) or not x.is_floating_point() or dim not in (-1, x.dim() - 1):
        return None
    if x.dim() == 6:  # (B, 1, kv heads, repeats, Lq, Lk): tiny-llm's grouped scores, a batch shape (*B, -1, ...) of one
        if x.shape[1] != 1:
            return None
        x = x[:, 0]
    one = x.dim() == 2  # (B, Lk): one query's scores against a memory (only read where they came from q @ kᵀ: scores.py)
    if one:
        x = x[:, None, :]
    lead = None
    if x.dim() == 5:  # grouped-query scores (B, kv heads, repeats, Lq, Lk), as MLX ports write them: head g*R + r;
        # or (B, N, H, Lq, Lk) with a batch-like axis N (OpenFold's MSA rows): kept, for checks/heads.py to tell apart
        lead = tuple(int(n) for n in x.shape[:3])
        x = x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[-2:])
    scores = x.detach()
    lowest = torch.finfo(scores.dtype).min
    masked = (scores == float("-inf")) | (scores == lowest)
    infinite = scores == float("-inf")
    fill = "-inf" if bool(infinite.any()) else "min" if bool(masked.any()) else None
    q_len, k_len = x.shape[-2:]
    shape = (x.shape[0], x.shape[1], q_len, k_len) if x.dim() == 4 else (x.shape[0], 1, q_len, k_len)
    details = {"fill": fill} if lead is None else {"fill": fill, "lead": lead}
    if fill == "-inf":  # only a row -inf everywhere is NaN; one that also holds the lowest value is uniform
        details["nan_rows"] = bool(infinite.all(dim=-1).any())
    masked = masked | _finite_fill(scores, lowest, details)
    _nan_scores(scores, details)
    if "nan_scores" in details:  # (a NaN score is the activations', not a cell the mask left: its row's softmax is NaN
        masked = masked | torch.isnan(scores)  # whatever it sees; read as no key, not as one seen: TimesFM 1b95563)
    if q_len > 1 and bool(masked.any()) and bool((masked == masked[..., :1, :]).all()):
        details["mask_rows"] = 1  # every query masks the same keys: one row for every query, as sdpa says of a
        # (B, 1, 1, Lk) attn_mask (the Annotated Transformer's masked_fill(src_mask == 0, -1e9)): key padding
    if one:
        details["one_query"] = True  # (a decoder state against encoder states, Luong's and Bahdanau's: cross-attention)
        details["cross"] = {"cross": True, "by": "scores", "source": "one query's scores against a memory, (B, Lk)"}
    seen = Seen("softmax", shape, tuple(x.shape), (), (), _dtype(x), str(x.device), details=details)
    seen.keep = (~masked).reshape(shape)
    return seen


def exp_softmax(args: tuple, kwargs: dict, axes: tuple | None = None) -> Seen | None:
    """exp of attention scores: a softmax written by hand (ONNX's reference `exp(x - max(x)) / sum`), read as one over
    its input's last axis; on scores.py's q @ kᵀ only, those laid out otherwise (layouts.py) permuted by exp_reader."""
    x = softmax_input(args, kwargs)
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
        return None
    seen = softmax((x, -1), {})
    if seen is not None:
        seen.details.update(by_hand="exp", **({"axes": list(axes)} if axes else {}))  # (the permuted view read)
    return seen


def exp_reader(scores, weights=None):
    """The reader of torch.exp / Tensor.exp: exp_softmax where the input is scores (trace/scores.py), not a softmax's
    weights or what is made of them alone (trace/weights.py: AKT's distance decay), else no call."""
    def exp(args, kwargs):  # (seen only while the mode follows scores: exp is not patched at its entry)
        x = softmax_input(args, kwargs)
        ours = isinstance(x, torch.Tensor) and scores.has(x) and (weights is None or not weights.has(x))
        axes = scores.axes_of(x) if ours else None  # (an einsum's other order, sglang-jax's "qhd,khd->qhk": its keys')
        seen = exp_softmax((x.permute(axes),) if axes else args, {} if axes else kwargs, axes) if ours else None
        held = scores.shifted.get(id(x)) if seen is not None and scores.shifted and not axes else None
        if held is not None and held[0]() is x:  # (rows filled whole, then shifted by their max: trace/shifted.py)
            hide(seen, held[1])
        return seen
    exp.api, exp.of_scores = "softmax", True  # (follow.py asks scores.has before any frame is read)
    return exp


sdpa.api, mha.api, softmax.api, exp_softmax.api = "sdpa", "mha", "softmax", "softmax"  # named on a call maskcli could not read
