"""Which softmax is attention: the one over scores that came from q @ kᵀ, or whose shape says so.

A model's last softmax is over its logits (B, T, vocab), which is no attention call (minGPT's generate, a sampling
loop). So while tracing, the outputs of matmul, bmm, baddbmm and einsum of two batched operands (q @ kᵀ: both at least
3-D, where a projection's weight is 2-D), and of mm / matmul of two 2-D tensors neither of which is a parameter (one
unbatched sequence's q @ kᵀ, a graph's nodes: read (1, 1, Lq, Lk)), are remembered by identity, and so is every tensor
computed from one of them that keeps its last two dimensions (the scaling, masked_fill, an added mask or bias, a cast):
a softmax over one of those is attention. A softmax over a tensor maskcli saw no matmul make (scores built by hand, or
made before the trace began) is attention where its shape says so: 4-D (B, H, Lq, Lk), or 3-D with as many queries as
keys. Scores in another axis order that their einsum states, or that the program permuted (Transformer-XL's
(Lq, Lk, B, H)), carry that order (layouts.py): a softmax over their keys is read through a permuted view.
"""

from __future__ import annotations

import weakref

import torch

import maskcli.trace.headquery as headquery
from maskcli.trace.copiedfold import copied_fold
from maskcli.trace.followed import batched, operands_of
from maskcli.trace.headadded import heads_apart
from maskcli.trace.handkv import keyed
from maskcli.trace.keyrows import key_rows, noted
from maskcli.trace.scorejoin import keys_joined as _keys_joined, sink_joined as _sink_joined
from maskcli.trace.layouts import NONE, TURNS, carried, einsum_axes, query_by_key as _query_by_key
from maskcli.trace.posbias import addend as pos_addend, carried as carried_bias
from maskcli.trace.regrouped import Pending, einsum_axes as regrouped_axes
from maskcli.trace.weakfill import WHERES, carry
from maskcli.trace.sliced import tail
from maskcli.trace.shifted import SUBS, filled_rows
from maskcli.trace.tiled import tile
from maskcli.trace.undone import BOUNDED, lifted

MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.bmm,
           torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.einsum, torch.mm, torch.Tensor.mm}
PLAIN = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm}
ADDS = {torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
        torch.Tensor.__iadd__}
ADDEND_MOST = 1 << 22  # cells of an added mask read for 0s and 1s at most
KEEP = 256  # live tensors remembered at most (more: all forgotten; the dead ones go as they die)
RESHAPES = {torch.reshape, torch.Tensor.reshape, torch.Tensor.view, torch.flatten, torch.Tensor.flatten}
CATS = {torch.cat, torch.concat, torch.concatenate}
HEADS, banded, stated_heads = headquery.HEADS, headquery.banded, headquery.stated_heads  # (a module's own head count)


class Scores:
    """The tensors that are attention scores, by identity (a weak reference each: nothing is kept alive)."""

    def __init__(self):
        self._found: dict[int, weakref.ref] = {}
        self.axes: dict[int, tuple] = {}  # id -> the axis order of scores not laid out (.., Lq, Lk) (layouts.py)
        self.added: dict[int, torch.Tensor] = {}  # id -> a float mask of only 0s and 1s added to these scores (ones_added)
        self.matrices: set[int] = set()  # ids of 2-D scores (Lq, Lk) of one unbatched sequence (per_graph), not (B, Lk)
        self.sinks: dict[int, tuple] = {}  # id -> (a weak reference, the keys before it) of scores joined to a sink column
        self.folds: dict[int, tuple] = {}  # id -> (B, H) of scores whose rows are a (B, H, ..) query viewed batch-major
        self.weak: dict[int, tuple] = {}  # id -> (fill, cells) a fill of about zero replaced in these scores (weakfill.py)
        self.sliced: dict[int, tuple] = {}  # id -> (start, length) of scores whose kᵀ is the tail of a longer key tensor
        self.flat: dict[int, tuple] = {}  # id -> (a weak reference, the scores' shape) of scores' rows folded to 2-D
        self.biased: dict[int, tuple] = {}  # id -> the float tensors added to these scores (posbias.py)
        self.tiles: dict[int, list] = {}  # id -> the batch, query and key spans of scores of one tile (tiled.py)
        self.shifted: dict[int, tuple] = {}  # id -> (a weak reference, rows filled whole) of scores less their row max
        self.regrouped = Pending()  # the last q @ kᵀ whose q or k was viewed with heads before positions (regrouped.py)
        self.keyrows: dict[int, object] = {}  # id -> one decode query's key fingerprint per row and key (keyrows.py)
        self.heads: dict[int, int] = {}  # id -> scores of one query per head, made by an einsum (trace/headquery.py)
        self.keyed: dict[int, tuple] = {}  # id -> weak references to the q and kᵀ of q @ kᵀ (trace/handkv.py)

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        """Note `out` of torch function `func` when it is q @ kᵀ, or computed from scores with their last two dims."""
        if not isinstance(out, torch.Tensor) or out.dim() < 3:
            if func is torch.einsum and headquery.noted(self, args, out):  # (one query per head: trace/headquery.py)
                return
            if func in PLAIN and per_graph(args):  # (one sequence's q @ kᵀ unbatched: a graph's nodes, q.mm(k.T))
                self._note(out, matrix=True)
                return
            if func in RESHAPES and isinstance(out, torch.Tensor) and out.dim() == 2 and self._found and args \
                    and isinstance(args[0], torch.Tensor) and self.has(args[0]) and _rows_folded(args[0], out) \
                    and not _one_query(args[0], out):  # (one query's (B, Lk) scores: noted below)
                if len(self.flat) >= KEEP:
                    self.flat.clear()  # (entries of dead tensors, read only through their weak reference)
                self.flat[id(out)] = (weakref.ref(out), tuple(args[0].shape))  # (d2l's masked_softmax: the scores' rows
                return  # folded to (B * Lq, Lk), filled in place, viewed back)
            if isinstance(out, torch.Tensor) and out.dim() == 2 and self._found and args and isinstance(args[0], torch.Tensor) \
                    and self.has(args[0]) and (_one_query(args[0], out) or args[0].shape == out.shape):
                heads = self.heads.get(id(args[0])) if self.heads and args[0].shape == out.shape else None
                self._note(out, matrix=id(args[0]) in self.matrices and args[0].shape == out.shape)  # (one decoder state against a memory, Luong's bmm(context, h[:, :, None]).squeeze(2),
                # and what is computed from those (B, Lk) scores: its masked_fill, its scaling)
                self.heads.update({} if heads is None else {id(out): heads})  # (one query per head: headquery.py)
            return
        if func in MATMULS:
            operands = operands_of(func, args)
            if func in (torch.baddbmm, torch.Tensor.baddbmm):
                operands = operands[1:3]  # (input, batch1, batch2): the product is batch1 @ batch2
            if sum(isinstance(x, torch.Tensor) and x.dim() >= 3 and batched(x) for x in operands) >= 2:
                if func is not torch.einsum or _query_by_key(args[0]):
                    self._note(out)
                    fold = batch_major(operands[0], out) or copied_fold(operands[0], out)
                    if fold is not None:
                        self.folds[id(out)] = fold
                    part = tile(operands[0], operands[1], turned=func is not torch.einsum) if len(operands) == 2 else None
                    if part is not None:
                        self.tiles[id(out)] = part
                    if len(operands) == 2 and func is not torch.einsum:  # (q or kᵀ viewed with heads before positions)
                        self.regrouped.note(operands[0], operands[1], out)
                    elif len(operands) == 2:  # (an einsum's q and k, their position axes read off its equation)
                        axes = regrouped_axes(args[0])
                        if axes is not None:
                            self.regrouped.note(operands[0], operands[1], out, axes)
                    cut = tail(operands[1], turned=True) if len(operands) == 2 and func is not torch.einsum else None
                    if cut is not None and tail(operands[0]) != cut:  # (q @ kᵀ over keys sliced off a cache's tail:
                        # trace/sliced.py; q sliced alike is a packed batch's last request, its own keys)
                        self.sliced[id(out)] = cut
                    if len(operands) == 2 and func is not torch.einsum:  # (q and kᵀ, read at weights @ V: handkv.py)
                        keyed(self.keyed, out, operands)
                        if out.shape[-2] == 1:  # (a decode step)
                            noted(self.keyrows, out, key_rows(operands[1], turned=True))
                else:  # (the equation states another axis order: Transformer-XL's "ibnd,jbnd->ijbn")
                    axes = einsum_axes(args[0], out.dim())
                    if axes is not None:
                        self._note(out, axes)
                    else:  # (one query per head against its keys, "bhd,bnhd->bhn": trace/headquery.py)
                        headquery.noted(self, args, out)
            return
        if not self._found:
            return
        if func in CATS:
            if _keys_joined(self, args, kwargs, out):
                self._note(out)
                keys = _sink_joined(self, args, kwargs)
                if keys is not None:
                    if len(self.sinks) >= KEEP:
                        self.sinks.clear()
                    self.sinks[id(out)] = (weakref.ref(out), keys)
            return
        if self.flat and func in RESHAPES and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.flat:
            held = self.flat[id(args[0])]
            if held[0]() is args[0] and tuple(out.shape) == held[1]:
                self._note(out)  # (the folded rows viewed back as the scores they were)
                return
        laid = self.axes or func in TURNS
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.Tensor) and self.has(x):
                if laid:  # (scores in another axis order, or turned into one: layouts.py)
                    axes = carried(func, args, kwargs, x, out, self.axes.get(id(x)))
                else:  # (plain scores: what keeps their last two dimensions is scores)
                    axes = None if tuple(x.shape[-2:]) == tuple(out.shape[-2:]) else NONE
                if axes is not NONE:
                    addend = self.added.get(id(x)) if self.added else None
                    biased = self.biased.get(id(x), ()) if self.biased or func in ADDS else None  # (read before
                    # _note: an in-place add's `out` is `x`)
                    fold = self.folds.get(id(x)) if self.folds and axes is None else None  # (read first: an in-place
                    part, sink = (None if not held or axes is not None else held.get(id(x)) for held in (self.tiles, self.sinks))
                    self._note(out, axes)  # op's `out` is `x`, whose entry _note clears, FastPitch's attn_score.mul_)
                    if sink is not None and sink[0]() is x:  # (a sink joined, then shifted: gpt-oss's QK - QK.max)
                        self.sinks[id(out)] = (weakref.ref(out), sink[1])
                    if fold is not None:
                        self.folds[id(out)] = fold  # (the mask added to folded scores: folded alike)
                    if part is not None:
                        self.tiles[id(out)] = part
                    rows = filled_rows(func, args, x, out) if func in SUBS and axes is None else None
                    if rows is not None:  # (a row filled whole, shifted by its max: read as no key, shifted.py)
                        self.shifted = {} if len(self.shifted) >= KEEP else self.shifted
                        self.shifted[id(out)] = (weakref.ref(out), rows)
                    for facts in (self.sliced, self.keyrows, self.heads, self.keyed) if axes is None else ():  # (kᵀ a cache's tail: sliced.py;
                        if facts and id(x) in facts:  # a decode query's keys per row: keyrows.py)
                            facts[id(out)] = facts[id(x)]
                    if func in ADDS and addend is None:
                        addend = _zero_one(args, x, out)
                    if addend is not None and axes is None:
                        self.added[id(out)] = addend
                    if biased is not None and axes is None:  # (a bias added, carried to the softmax: posbias.py)
                        carried_bias(self.biased, biased, out, pos_addend(args, x, out) if func in ADDS else None)
                    if axes is None and (self.weak or func in WHERES):
                        carry(self.weak, self.has, func, args, kwargs, x, out)
                    if axes is None and func in BOUNDED:  # (a fill lifted back by tanh, a clamp: undone.py)
                        lifted(self.weak, func, x, out)
                    return

    def ones_added(self, x, call, seen) -> None:
        """At softmax `call` over scores `x`: details["zero_one"] where a 0/1 mask added to them masked nothing in some
        row (checks/kernels.py's ones-added, as for SDPA's float attn_mask)."""
        addend = self.added.get(id(x)) if isinstance(x, torch.Tensor) and self.has(x) else None
        if addend is None or "axes" in seen.details:
            return
        apart = heads_apart(addend, x)  # (one value per head, differing: a head mask the softmax cancels, headadded.py)
        if apart is not None:
            call.details["heads_added"] = seen.details["heads_added"] = apart
        keep = seen.keep if seen.keep is not None else seen.materialize()
        if zero_one_seen(addend, x, keep):
            call.details["zero_one"] = seen.details["zero_one"] = True

    def fold_of(self, x, call, seen) -> None:
        """At softmax `call` over scores `x`: details["fold"] = [B, H] where their rows are a (B, H, ..) query tensor
        viewed as B * H rows, batch-major (row n is sample n // H): checks/arguments.py reads the batch one way round."""
        fold = self.folds.get(id(x)) if isinstance(x, torch.Tensor) and self.has(x) else None
        if fold is not None and "axes" not in seen.details:
            call.details["fold"] = seen.details["fold"] = list(fold)

    def sliced_of(self, x, call, seen) -> None:
        """At softmax `call` over scores `x`: details["keys_sliced"] where their kᵀ was a cache's tail (trace/sliced.py)."""
        cut = self.sliced.get(id(x)) if isinstance(x, torch.Tensor) and self.has(x) else None
        if cut is not None and "axes" not in seen.details:
            call.details["keys_sliced"] = seen.details["keys_sliced"] = cut

    def tile_of(self, x, call, seen) -> None:
        """At softmax `call` over scores `x`: details["tile"] where they are one tile of a larger attention (tiled.py)."""
        part = self.tiles.get(id(x)) if isinstance(x, torch.Tensor) and self.has(x) else None
        if part is not None and "axes" not in seen.details:
            call.details["tile"] = seen.details["tile"] = part

    def sink(self, x) -> int | None:
        """The keys of scores `x` whose last column is a sink joined to them (_sink_joined); None where none is."""
        held = self.sinks.get(id(x)) if self.sinks and isinstance(x, torch.Tensor) else None
        return held[1] if held is not None and held[0]() is x else None

    def has(self, tensor: torch.Tensor) -> bool:
        found = self._found.get(id(tensor))
        return found is not None and found() is tensor

    def attention(self, x: torch.Tensor) -> bool:
        """A softmax over `x` (its last dimension) is an attention call."""
        if not isinstance(x, torch.Tensor):
            return False
        if self.has(x):
            return True
        return x.dim() == 4 or (x.dim() == 3 and x.shape[-1] == x.shape[-2])

    def axes_of(self, x) -> tuple | None:
        """The axis order of scores `x` (layouts.py), None where plain or not scores."""
        return self.axes.get(id(x)) if self.axes and self.has(x) else None

    def _note(self, tensor: torch.Tensor, axes: tuple | None = None, matrix: bool = False) -> None:
        found, laid, matrices = self._found, self.axes, self.matrices  # (one dict for the trace's life: the mode reads
        per_id = (self.added, self.folds, self.weak, self.sliced, self.tiles, self.biased, self.keyrows, self.heads,
                  self.keyed)  # (facts by a tensor's id)
        if len(found) >= KEEP:  # it as "following")
            found.clear()
            laid.clear()
            self.flat.clear()
            matrices.clear()
            for facts in per_id:
                facts.clear()
        key = id(tensor)
        for facts in per_id:
            facts.pop(key, None)  # (an id a dead tensor had, now this one's)

        def gone(ref) -> None:  # a tensor let go is forgotten at once, so the mode stops following when none is left
            if found.get(key) is ref:  # (its id reused by a later tensor: that one keeps its own entry)
                del found[key]
                laid.pop(key, None)
                for facts in per_id:
                    facts.pop(key, None)
                matrices.discard(key)

        try:
            found[key] = weakref.ref(tensor, gone)
        except TypeError:  # (a tensor subclass without weak references: not remembered)
            return
        if axes is not None:
            laid[key] = axes
        elif laid:
            laid.pop(key, None)
        if matrix:
            matrices.add(key)
        elif matrices:
            matrices.discard(key)


def _rows_folded(x: torch.Tensor, out: torch.Tensor) -> bool:
    """`out` is scores `x` (B.., Lq, Lk) with every axis but the keys' folded into its rows: (B * .. * Lq, Lk)."""
    return x.dim() >= 3 and out.shape[-1] == x.shape[-1] and out.numel() == x.numel()


def batch_major(a, out) -> tuple[int, int] | None:
    """(B, H) where the scores' first operand `a` (B * H, Lq, D) is a view of a contiguous-in-its-first-two-axes 4-D
    (B, H, Lq, D) tensor flattened batch-major (`q.view(B * H, L, D)` of `_shape`'s (B, H, L, D): ProphetNet's and
    BART's eager attention), B and H both 2 or more; None where the layout is not so known (a `cat` of split heads)."""
    try:
        base = a._base if isinstance(a, torch.Tensor) and a.dim() == 3 and out.dim() == 3 else None
        if base is None or base.dim() != 4:
            return None
        rows, heads = int(base.shape[0]), int(base.shape[1])
        if rows < 2 or heads < 2 or rows * heads != a.shape[0] or a.storage_offset() != base.storage_offset():
            return None
        if a.stride(0) != base.stride(1) or base.stride(0) != heads * base.stride(1) or a.shape[1] != base.shape[2]:
            return None
        return rows, heads
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def as_matrix(softmax, scores: Scores, args: tuple, kwargs: dict):
    """The reader of a softmax over 2-D scores of one unbatched sequence (Scores.matrices): read as (1, Lq, Lk), one
    batch row of Lq queries, not as the (B, Lk) single-query scores a 2-D softmax is otherwise read as."""
    x, dim = _rows_of(args, kwargs)
    if x is None or id(x) not in scores.matrices or not scores.has(x) or dim not in (-1, 1):
        return softmax

    def matrix(args_, kwargs_):
        return softmax((x[None], -1), {})

    matrix.api = "softmax"
    return matrix


def as_unfolded(softmax, scores: Scores, args: tuple, kwargs: dict):
    """The reader of a softmax over scores whose rows were folded to 2-D (Scores.flat: `attn.view(-1, len_k)`, as
    attention-is-all-you-need-pytorch's first ScaledDotProductAttention softmaxes them): read as the scores they were."""
    x, dim = _rows_of(args, kwargs)
    held = None if x is None else scores.flat.get(id(x))
    if held is None or held[0]() is not x or dim not in (-1, 1):
        return softmax

    def unfolded(args_, kwargs_):
        return softmax((x.view(held[1]), -1), {})

    unfolded.api = "softmax"
    return unfolded


def _rows_of(args: tuple, kwargs: dict) -> tuple:
    """(a softmax's 2-D input, else None; its dim) from its arguments."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    return (x if isinstance(x, torch.Tensor) and x.dim() == 2 else None), (args[1] if len(args) > 1 else kwargs.get("dim"))


def per_graph(args: tuple) -> bool:
    """A product of two 2-D tensors neither of which is a parameter or a view of one (x @ W is a projection, whose
    weight is one): q @ kᵀ of one unbatched sequence (a graph's nodes, as Graphormer's head computes
    query.mm(key.transpose(0, 1))), noted as scores; a softmax over them, or over what keeps their shape, is attention,
    and no other 2-D softmax is."""
    if len(args) != 2:
        return False
    a, b = args
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2 \
        and not _weight(a) and not _weight(b)


def _weight(x: torch.Tensor) -> bool:
    return isinstance(x, torch.nn.Parameter) or isinstance(x._base, torch.nn.Parameter)


def _zero_one(args: tuple, scores: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """The other operand of scores + mask where it is a float tensor of only 0s and 1s, some of each, that broadcasts to
    the sum: a keep (or pad) mask cast to float and added as it is, which masks nothing (QEfficient#1159)."""
    other = next((a for a in args[:2] if isinstance(a, torch.Tensor) and a is not scores), None)
    if other is None or not other.is_floating_point() or other.dim() < 2 or other.numel() > ADDEND_MOST \
            or other.device.type == "meta" or len(args) > 2:  # (add(x, y, alpha=...): not a plain sum)
        return None
    with torch.no_grad():
        zeros = other == 0
        if not bool(zeros.any()) or not bool((zeros | (other == 1)).all()) or bool(zeros.all()):
            return None
        try:
            torch.broadcast_shapes(other.shape, out.shape)
        except RuntimeError:
            return None
        return other.detach() == 1


def zero_one_seen(addend: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None) -> bool:
    """A query row of the softmax over `x` (scores plus the 0/1 `addend`, bool: where it adds 1) whose keys it sees
    (`keep`, the call's mask) include keys the addend sets apart (some added 1, some 0): the mask the program built
    masks nothing there. Not where something else masks one side away (a masked_fill beside the addition)."""
    if keep is None:
        return False
    with torch.no_grad():
        try:
            ones = addend.broadcast_to(x.shape).reshape(keep.shape)
        except RuntimeError:
            return False
        both = (keep & ones).any(dim=-1) & (keep & ~ones).any(dim=-1)
        return bool(both.any())


def _one_query(scores, out: torch.Tensor) -> bool:
    """`out` (B, Lk) is 3-D scores (B, Lk, 1) or (B, 1, Lk) with their one query's dimension dropped."""
    return isinstance(scores, torch.Tensor) and scores.dim() == 3 and 1 in scores.shape[1:] \
        and out.shape[0] == scores.shape[0] and out.shape[1] == scores.shape[1] * scores.shape[2]
