"""What a trace lets pass and what it follows: Trace.dispatch, and the mode on in a thread only while it follows.

entry.py's wrappers and the mode (mode.py) hand watched calls here; a trace mixes this in (capture.py).
"""

from __future__ import annotations

import threading

import torch

import maskcli.trace.evaldrop as evaldrop
import maskcli.trace.headquery as headquery
import maskcli.trace.keyrows as keyrows
import maskcli.trace.masks as readers
import maskcli.trace.overqueries as overqueries
from maskcli.trace.discarded import FILLS as DISCARDED
from maskcli.trace.layouts import heads_first, reader as laid
from maskcli.trace.maskmean import REDUCES
from maskcli.trace.mode import Mode, building, has_values
from maskcli.trace.after import MULS
from maskcli.trace.permuted import GATHERS, noted
from maskcli.trace.pooled import Pooled
from maskcli.trace.poolweights import Pool, attended, weighting
from maskcli.trace.posbias import bias_of
from maskcli.trace.ranked import TOPS, Ranked
from maskcli.trace.overflow import ADDS, BOOL_FILLS, IN_PLACE, WATCHED
import maskcli.trace.sinusoid as sinusoid
from maskcli.trace.regrouped import reshaped
from maskcli.trace.scores import HEADS, MATMULS, RESHAPES, as_matrix, as_unfolded, stated_heads
from maskcli.trace.shifted import shifted_reader
from maskcli.trace.singleton import read as read_singleton, singleton, wider
from maskcli.trace.unseen import plain, unseen
from maskcli.trace.weakfill import weak_filled



_WHOLE = object()  # (Follow._before: a piece of a call its Hugging Face interface records whole)


class Local(threading.local):
    """What each thread of the program has of a trace (the defaults: class attributes, read without a getattr default)."""

    busy = False  # recording a call now
    within = 0  # inside a recorded call
    outer = None  # [frame, module, args, kwargs, first call, end] of the outermost module call making calls now
    mode = None  # this thread's Mode, made once it is first needed
    moded = False  # that mode is on this thread's torch function stack (pushed by Trace._follow)
    traced = False  # the thread that entered the trace, or one started while tracing


class Traced:
    """A thread started while tracing, traced as the main one is (threads.py enters and leaves it around its run)."""

    def __init__(self, trace):
        self.trace = trace

    def __enter__(self):
        self.trace._local.traced = True

    def __exit__(self, *exc):
        self.trace._local.traced = False
        self.trace._leave_thread()


class Follow:
    """Trace's dispatch of watched calls (capture.py's Trace mixes this in)."""

    ranked = None  # (the trace's Ranked, made at its first topk over scores: trace/ranked.py)
    _pooled = None  # (the trace's Pooled, made at its first softmax of no attention: trace/pooled.py)

    def _followers(self) -> None:
        """What the mode follows of a call once seen, beside the scores and a softmax's weights: softmax outputs
        multiplied by a 0/1 mask afterwards (after.py), fills and casts that may overflow (overflow.py) or be thrown away
        (discarded.py), a model output read per row (poolrows.py), a mask's count a mean divides by (maskmean.py); and
        the tables of their live tensors, any of which keeps the mode on (_followed)."""
        from maskcli.trace.after import After
        from maskcli.trace.discarded import Discarded
        from maskcli.trace.maskmean import MaskMean
        from maskcli.trace.multiplied import Products
        from maskcli.trace.overflow import Overflows
        from maskcli.trace.poolrows import PoolRows
        from maskcli.trace.rescored import Rescored
        from maskcli.trace.rowsout import RowsOut

        self.after, self.overflows, self.discarded = After(), Overflows(), Discarded()
        self.poolrows, self.maskmean, self.products, self.rowsout = PoolRows(), MaskMean(), Products(), RowsOut()
        self.rescored = Rescored()  # (an exp of scores a softmax then runs over: no softmax by hand, rescored.py)
        scores = self.scores._found if self.scores is not None else {}
        self._followed = (self.overflows._found, scores, self.after._found, self.weights._found, self.poolrows._found,
                          self.maskmean._found, self.rowsout._found, self.rescored._found)

    # --- what passes, and the mode --------------------------------------------------------------

    def passes(self) -> bool:
        """Whether a watched call now runs as it would untraced (entry.py's wrappers): the trace ended, maskcli is
        recording, a thread it does not trace, dynamo compiling (mode.building), or this thread's mode is on (it hands
        the call to dispatch itself)."""
        local = self._local
        if local.moded:
            if any(self._followed):
                _above_device(local.mode)  # (ours back over the program's DeviceContext, where it landed beneath)
                return True
            if not self._unfollow():
                return True
        return not self.active or local.busy or not local.traced or building()

    def _follow(self) -> None:
        """This thread's mode on: a tensor is followed now."""
        local = self._local
        if local.moded or not self.active or not local.traced or building():
            return
        if local.mode is None:
            local.mode = Mode(self)
        torch._C._push_on_torch_function_stack(local.mode)
        local.moded = True

    def _unfollow(self) -> bool:
        """This thread's mode off, where it is the innermost mode (not inside its own handler, nor under a mode the
        program entered since); whether it is off now."""
        local = self._local
        if torch.overrides._get_current_function_mode() is not local.mode and not _above_device(local.mode) \
                or building():
            return False
        torch._C._pop_torch_function_stack()
        local.moded = False
        return True

    def _leave_thread(self) -> None:
        """This thread's mode off as the trace ends here (or a traced thread ends)."""
        if self._local.moded:
            self._unfollow()
            self._local.moded = False

    def dispatch(self, func, args: tuple, kwargs: dict, call):
        """A watched call (or, while a tensor is followed, any): recorded where it is attention, what it computes
        followed (scores.py, overflow.py, after.py), run as `call(*args, **kwargs)` and its result returned untouched."""
        followed = self._followed
        if not self.active or (func not in self.watched and not any(followed)) or building():
            return call(*args, **kwargs)
        reader = self.readers.get(func)
        if reader is readers.softmax and not any(followed) and not self.discarded._found and not _by_shape(args, kwargs):
            if wider(args, kwargs):  # (a line that softmaxes more elements: its one-element runs are data's)
                self.singles.wider()
            out = call(*args, **kwargs)  # (no scores, weights or fill remembered: a softmax of no attention shape is
            # no attention, and nothing it computes is followed; decided before anything of it is read)
            self.pooled().note(args, kwargs, out)  # (but its weights pooled off their axis: trace/pooled.py)
            return out
        if reader is not None and not self.busy and not self.within:
            try:
                if plain(args, kwargs):
                    read = self._before(reader, args, kwargs)
                else:
                    with unseen():
                        read = self._before(reader, args, kwargs)
            except (Exception, SystemExit):  # noqa: BLE001 - nothing of the trace may reach the program: the call runs unread
                read, self._softmax = None, None
            if read is _WHOLE:
                return call(*args, **kwargs)
            if read is not None:
                made, softmaxed = read
                self.within += 1  # (what the call runs itself is its own: MHA's SDPA, F.softmax's Tensor.softmax)
                try:
                    out = call(*args, **kwargs)
                except BaseException as error:
                    self.refused(made, error)
                    raise
                finally:
                    self.within -= 1
                if made < len(self._calls) and self._calls[made].details.get("dropout_p"):
                    evaldrop.sdpa(self._calls[made])  # (dropout_p > 0 in eval mode: trace/evaldrop.py)
                self.after_call(func, args, kwargs, out, softmaxed)
                return out
        out = call(*args, **kwargs)
        if reader is readers.softmax:
            self.pooled().note(args, kwargs, out)
        self.after_call(func, args, kwargs, out)
        return out

    def pooled(self) -> Pooled:
        """The softmaxes of no attention remembered, and the products that pool their weights (trace/pooled.py)."""
        if self._pooled is None:
            self._pooled = Pooled()
        return self._pooled

    def _before(self, reader, args: tuple, kwargs: dict):
        """Record an attention call before it runs: (the index it is recorded at, (call, seen) of a softmax read, else
        None); None where it is no attention (a softmax over no scores), _WHOLE where its interface records it."""
        if getattr(reader, "wanted", None) is not None and not reader.wanted(args, kwargs):
            return None  # (an einsum that is no linear attention's key summary: its equation says so, trace/linearattn.py)
        if getattr(reader, "of_scores", False) and not self.scores.has(readers.softmax_input(args, kwargs)):
            return None  # (an exp or activation of no q @ kᵀ, a feed-forward's silu: no call, known before a frame is read)
        given = readers.softmax_input(args, kwargs) if reader is readers.softmax else None
        unfolded = as_unfolded(reader, self.scores, args, kwargs) if reader is readers.softmax and self.scores.flat else reader
        if unfolded is not reader:
            reader = unfolded  # (a softmax over scores' rows folded to 2-D: scores.py)
        elif reader is readers.softmax and singleton(args, kwargs) and not self.scores.has(given):
            reader = read_singleton  # (one element, over no q @ kᵀ: each weight 1, trace/singleton.py)
        elif reader is readers.softmax and not self.scores.attention(given) \
                and self.discarded.dropped(given) is None:  # (a fill of its input, thrown away, says so)
            if wider(args, kwargs):
                self.singles.wider()
            return None
        if reader is readers.softmax and overqueries.wanted(given, args, kwargs) and self.scores.has(given) \
                and self.scores.axes_of(given) is None:  # (over the queries of plain scores: overqueries.py)
            reader = overqueries.read
        elif reader is readers.softmax and self.scores.axes:  # scores in another axis order (layouts.py)
            reader = laid(reader, self.scores, args, kwargs)
        elif reader is readers.softmax and self.scores.matrices:  # one sequence's (Lq, Lk) (scores.py)
            reader = as_matrix(reader, self.scores, args, kwargs)
            if reader is not readers.softmax and self.interfaces:  # (one piece of a Hugging Face attention
                return _WHOLE  # function's call, a document or a head: its interface records the whole)
        if reader is readers.softmax and self.scores.heads:  # (one query per head, an einsum's: trace/headquery.py)
            reader = headquery.reader(reader, self.scores, args, kwargs, lambda: self.sites.stack)
        if reader is readers.softmax and isinstance(given, torch.Tensor) and given.dim() == 4 \
                and given.shape[0] != given.shape[1] and self.scores.has(given):  # (H, B, Lq, Lk): layouts.heads_first
            reader = heads_first(reader, self.scores, args, kwargs, lambda: None if _transformers(self.sites.stack)
                                 else stated_heads(self.sites.stack, HEADS + ("heads",)))
        if given is not None and self.scores.shifted and reader is not read_singleton:  # (rows filled whole, less
            reader = shifted_reader(reader, self.scores, given)  # their max: shifted.py)
        if given is not None and self.rescored._found:  # (over an exp recorded as a softmax: that exp withdrawn)
            self.rescored.withdraw(self, given)
        self._softmax, made = None, len(self._calls)
        self.capture(reader, args, kwargs)
        if reader is read_singleton and len(self._calls) > made:
            self.singles.single(self._calls[-1])
        softmaxed, self._softmax = self._softmax, None
        if softmaxed is not None and given is not None:  # (a fill of its input thrown away, or bound and never read:
            self.discarded.note(given, *softmaxed, bound=self.scores is not None and self.scores.has(given))  # dropped())
        return made, softmaxed

    def capture(self, reader, args, kwargs) -> None:
        """Record one call (Trace._capture); whatever goes wrong here is noted on the call and never reaches the program."""
        made = len(self._calls)
        try:
            self._capture(reader, args, kwargs)
        except (Exception, SystemExit) as error:  # noqa: BLE001 - a frame held what maskcli cannot read: still a call, not read
            if len(self._calls) == made and getattr(reader, "records", True):  # (a reader of what the program states
                self._append(readers.Call(  # records none even where it fails: trace/losses.py, trace/tables.py)getattr(reader, "api", "?"), (0, 0, 0, 0), (), (), (), "", "", index=made,
                                          where="?", step=0, details={"error": f"{type(error).__name__}: {said(error)}"},
                                          trace=self))

    def after_call(self, func, args: tuple, kwargs: dict, out, softmaxed=None) -> None:
        """What a watched call computed, followed (dispatch's part after the call; entry.py's wrappers run it alone
        where a cast, a sum or a product may matter). Whatever goes wrong here stays here: the program has its result."""
        if building():  # (dynamo's own calls as it compiles: mode.building)
            return
        try:
            if plain(args, kwargs, out):
                self._after_call(func, args, kwargs, out, softmaxed)
            else:
                with unseen():
                    self._after_call(func, args, kwargs, out, softmaxed)
        except (Exception, SystemExit):  # noqa: BLE001 - nothing of the trace may reach the program: what the call made is not followed
            pass

    def after_fill(self, func, args: tuple, kwargs: dict, out) -> None:
        """after_call of an out-of-place masked_fill with a masking value that entry.py's wrapper let through: where no
        tensor is followed (no scores, weights or overflowed fill alive) nothing but the fill itself is to remember
        (discarded.py), which is all that runs: a loop of fills of no attention pays for no more."""
        followed = self._followed
        if building():
            return
        if any(followed) or self.scores is None:
            self.after_call(func, args, kwargs, out)
        else:
            self.discarded.after(func, args, kwargs, out)

    def _after_call(self, func, args: tuple, kwargs: dict, out, softmaxed=None) -> None:
        followed = self._followed
        if self.rowsout._armed is not None and not self.within:  # (the output of a call whose frames state a row
            self.rowsout.begin(self, out, softmaxed is not None)  # mask, followed: trace/rowsout.py)
        if self.discarded.results:  # (a fill's result read: not thrown away, discarded.py)
            self.discarded.reads(args, kwargs)
        if softmaxed is not None:  # its weights followed: a 0/1 mask multiplied in afterwards is its mask (after.py)
            self.after.note(out, *softmaxed)
            self.rescored.note(out, *softmaxed)  # (an exp's output: a softmax over it withdraws it, rescored.py)
            if self.scores is not None and self.scores.added:  # scores + a 0/1 mask: it masked nothing (scores.py)
                self.scores.ones_added(readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.products.found:  # scores * a 0/1 mask: logit 0 (multiplied.py)
                self.products.of(readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.scores.weak:  # a mask filled with about 0: it masks nothing (weakfill.py)
                weak_filled(self.scores.weak, self.scores.has, readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.scores.folds:  # a batch folded with its heads, batch-major (scores.py)
                self.scores.fold_of(readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.scores.sliced:  # q @ kᵀ over a cache's tail (trace/sliced.py)
                self.scores.sliced_of(readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.scores.biased:  # a bias added to the scores (trace/posbias.py)
                bias_of(self.scores.biased, self.scores.has, readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.scores.keyrows:  # a decode query's keys per row (trace/keyrows.py)
                keyrows.of(self.scores, readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.scores.tiles:  # one tile of a larger attention (trace/tiled.py)
                self.scores.tile_of(readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.scores.regrouped.pending is not None:  # q or k regrouped (regrouped.py)
                self.scores.regrouped.of(readers.softmax_input(args, kwargs), *softmaxed)
            if self.scores is not None and self.scores.keyed:  # (its q and kᵀ, read at weights @ V: trace/handkv.py)
                self.weights.keyed(self.scores.keyed.get(id(readers.softmax_input(args, kwargs))), softmaxed[0])
            if self.ranked is not None and self.ranked.pending is not None:  # a top-k taken over these scores (trace/ranked.py)
                self.ranked.of(readers.softmax_input(args, kwargs), *softmaxed)
            self.weights.note(out, *softmaxed, readers.softmax_input(args, kwargs))  # (its weights followed: weights.py)
        else:
            if followed[2] and not self.busy:
                self.after.after(self, func, args, out)
            if followed[3] and not self.busy:  # (what is computed of a softmax's weights: weights.py)
                self.weights.after(func, args, kwargs, out, self.scores)
            if followed[4] and not self.busy:  # (a model output read at one position per row: poolrows.py)
                self.poolrows.after(func, args, kwargs, out)
            if followed[6] and not self.busy:  # (rows a row mask states masked out, reaching a sum: rowsout.py)
                self.rowsout.after(func, args, kwargs, out)
            if followed[7] and not self.busy:  # (an exp's output scaled, filled: rescored.py)
                self.rescored.after(func, args, kwargs, out)
        if (followed[5] or func in REDUCES) and not self.busy:  # (a mean whose sum counts what its divisor does not:
            self.maskmean.after(func, args, kwargs, out, self._calls)  # maskmean.py)
        if (func in WATCHED or followed[0] or followed[1] and func in IN_PLACE) and isinstance(out, torch.Tensor) \
                and out.dim() >= 2 and out.is_floating_point() and not self.busy and has_values(out):
            self.overflows.after(func, args, kwargs, out, self.scores)  # (fills that overflow to -inf: overflow.py)
        elif func in BOOL_FILLS and isinstance(out, torch.Tensor) and out.dtype == torch.bool and not self.busy:
            self.overflows.bool_filled(args, kwargs, out)  # (a number filled into a bool mask: overflow.py)
        if func in ADDS and not self.busy:  # (a sinusoidal position encoding added to the inputs: sinusoid.py)
            sinusoid.note(self._local, args, out)
        if func in MATMULS and self._pooled is not None and self._pooled.held and not self.busy:
            reader = self._pooled.product(func, args, kwargs)  # (weights summed off their softmax's axis: pooled.py)
            if isinstance(reader, Pool):  # (or over it: a pooling, kept with its model call, poolweights.py)
                reader.keep(self)
            elif reader is not None:
                self.capture(reader, args, kwargs)
        if func in MULS and getattr(self._local, "moded", False) and not self.busy:  # (the wrappers' own path
            self.rotations.note(args, out)  # keeps it in poolweights.weighs_or: a rotary factor, trace/rotated.py)
        if func in MULS and self._pooled is not None and self._pooled.held and not self.busy:
            pool = weighting(self._pooled, args)  # (weights weighing values over their own axis: poolweights.py)
            if pool is not None and not attended(self, pool, args, kwargs):  # (additive attention: a call of its own)
                pool.keep(self)
        if func in DISCARDED and self._pooled is not None and self._pooled.held and not self.busy:
            self._pooled.filled(args, out)  # (weights with positions filled out of their pooling: pooled.py)
        if func in RESHAPES and not self.busy:  # (a (B, L, E) copied to (B, H, L, D): heads before positions, regrouped.py)
            reshaped(args, out)
        if func in GATHERS and not self.busy:  # (tokens reordered in each row: permuted.py)
            noted(self)(args, kwargs, out)
        if self.scores is not None:
            if func in TOPS:  # (a sparse top-k ranking scores along their keys: trace/ranked.py)
                self.ranked = self.ranked or Ranked()
                self.ranked.note(args, kwargs, out, self.scores.has)
            self.scores.after(func, args, kwargs, out)
            if func in MULS or self.products.found:  # (scores multiplied by a 0/1 tensor: trace/multiplied.py)
                self.products.after(func, args, out, self.scores.has)
            if func in DISCARDED:  # (an out-of-place fill of scores: discarded.py)
                self.discarded.after(func, args, kwargs, out)
        if any(followed) and not self._local.moded:
            self._follow()


def _by_shape(args: tuple, kwargs: dict) -> bool:
    """Whether a softmax's input is attention by its shape alone (scores.py's attention: 4-D, or 3-D square), or may be
    (not a plain tensor: the full path reads it)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if type(x) is not torch.Tensor:
        return True
    dims = x.dim()
    return dims == 4 or dims == 3 and x.shape[1] == x.shape[2] or x.shape[-1] == 1 and singleton(args, kwargs)


def said(error: BaseException) -> str:
    """An exception's message on one line, at most 200 characters (one whose __str__ raises: its class alone)."""
    try:
        return " ".join(str(error).split())[:200]
    except (Exception, SystemExit):  # noqa: BLE001 - the program's own exception class may print nothing
        return "(its message cannot be printed)"


def _transformers(stack: list) -> bool:
    """A module of transformers' own runs the call: its attention lays scores out (B, H, Lq, Lk) whatever head count a
    module states (JetMoe's mixture of attention heads: 2 heads a module says, 4 it attends with, over a batch of 2)."""
    return any(type(module).__module__.startswith("transformers.") for module in stack)


_DEFAULT = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)  # (set_default_device's, per thread: its `device_context`)


def _above_device(mode) -> bool:
    """Where torch's default-device mode sits right over ours, ours is put back on top of it; whether it was. The
    program's `torch.set_default_device` keeps its DeviceContext at the bottom of the stack, but ours, pushed from a patched Tensor method that the DeviceContext's
    own __torch_function__ called (a mode is off the stack while it handles a call), lands beneath it: there it could
    not be popped as the trace ends (left on for the process's later calls), and the program's next
    set_default_device finds a mode under its own ("Found nested DeviceContext on the mode stack")."""
    depth = torch._C._len_torch_function_stack()
    if depth < 2 or torch._C._get_function_stack_at(depth - 2) is not mode or building() \
            or torch._C._get_function_stack_at(depth - 1) is not getattr(_DEFAULT, "device_context", None):
        return False  # (a `with torch.device(...)` pushes its own on top and pops the top as it exits: left where it is)
    device = torch._C._pop_torch_function_stack()
    torch._C._pop_torch_function_stack()
    torch._C._push_on_torch_function_stack(device)
    torch._C._push_on_torch_function_stack(mode)
    return True
