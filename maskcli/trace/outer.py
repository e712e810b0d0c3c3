"""The outermost module calls that made attention calls, read from the frames at a call and finished as they end.

No hook runs on every module call: at an attention call the frames say which module calls are running
(sites.running); the outermost one is held, and its module gets hooks of its own so that its later calls are
finished as they end (what the checks read of each: tops.py). A trace mixes this in (capture.py).
"""

from __future__ import annotations

import sys

import functools
import os
import threading
import weakref

import torch

import maskcli.trace.assigned as assigned
import maskcli.trace.outrows as outrows
from maskcli.trace.convpad import adopt, stated_frames
from maskcli.trace.rewritten import rewrites


@functools.cache
def _own() -> tuple[str, ...]:
    """torch's code and maskcli's: their frames are not the program's."""
    return os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_HOLDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # outer module -> ids of the modules it holds


def _holds(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    """`inner` is one of `outer`'s modules (read once per outer module)."""
    held = _HOLDS.get(outer)
    if held is None:
        held = _HOLDS[outer] = frozenset(id(m) for m in outer.modules())
    return id(inner) in held


def _then(args: tuple, kwargs: dict) -> dict:
    """id -> (tensor, its version, a copy) of the small integer or bool tensors a call was handed (ids, masks,
    positions: what tops.py reads), read as a module's first call returns (it runs without the hooks registered inside
    it, so it is finished later): the program may change them in place before the call is finished (GritLM zeroes its
    instruction tokens in the attention_mask it handed the model, for its pooling); what the forward itself changed
    stays (FuxiCTR's adjust_mask: checks/latefix.py reads it)."""
    from maskcli.trace.padded import MOST

    kept = {}
    for value in (*args, *kwargs.values()):
        if type(value) is torch.Tensor and value.dim() <= 2 and value.numel() <= MOST \
                and (value.dtype == torch.bool or not value.is_floating_point()) and not value.is_complex():
            kept[id(value)] = (value, None if value.is_inference() else value._version, value.clone())
    return kept


def _masks_handed(module, args: tuple, kwargs: dict) -> bool:
    """The call was handed an integer or bool tensor of at most 4 dimensions under a name with `mask` in it (its
    attention_mask, padding_mask, a hand-written model's (B, 1, L) `src_mask`...: what the checks read of its arguments
    and a program may change after the call; and where its return is watched, its output rows are hashed, outrows.py)."""
    from maskcli.trace.tops import _given

    given = _given(module, args, kwargs)[1] if args else kwargs
    return any("mask" in name and type(value) is torch.Tensor and value.dim() <= 4 and not value.is_floating_point()
               for name, value in given.items())


def _as_then(value, then: dict):
    """`value`, or its copy from when `then` was read where it is a tensor changed in place since."""
    held = then.get(id(value))
    changed = held is not None and held[0] is value and (  # (inference_mode: no version counter, compared)
        held[1] != value._version if held[1] is not None else not torch.equal(held[2], value))
    return held[2] if changed else value


def _forward(frame, found: list):
    """The frame of the module's `forward` that `frame` (its _call_impl, or that forward itself) runs, or None."""
    if frame.f_code.co_name == "forward":
        return frame
    walk = found[-2][1] if len(found) > 1 else sys._getframe(1)
    while walk is not None and walk.f_back is not frame:
        walk = walk.f_back
    return walk


class Outer:
    """Trace's outermost module calls (capture.py's Trace mixes this in)."""

    # --- where a call comes from --------------------------------------------------------------

    def _outer(self, found: list, first: int) -> None:
        """Call `first` (and any after it) was made inside the outermost module call `found[-1]` (sites.running): that
        call held until it is finished (_finish), and its module hooked so that its later calls are finished as they
        end (a module's hooks are read as its call begins: this call ran without them)."""
        local, (module, frame, variables) = self._local, self._called(found[-1])
        held = local.outer
        if held is not None and held[0] is frame:
            held[5] = len(self._calls)
            self.poolrows.inside(found, held, self._follow, self._held_outer, self._handles)  # (a model call inside: poolrows.py)
            return
        if held is not None:
            self._finish(held)
        self.maskmean.forget()  # (a new model call: the counts made before it, let go)
        if id(module) not in self._frames and not (id(module) in self._stated and self._stated[id(module)][0] is module):
            from maskcli.trace.stated import frames

            self._frames[id(module)] = frames(frame=frame.f_back)  # (the program's frames as the module was called)
            from maskcli.trace.tokenizer import tokenizer

            try:  # (tops.py reads it once the call is finished, maybe after the run: the frames are the call's now)
                tokenizer(module, frame.f_back)
            except (Exception, SystemExit):  # noqa: BLE001 - a program object that cannot be read: no tokenizer read
                pass
        args, kwargs = variables.get("args", ()), variables.get("kwargs", {})
        from maskcli.trace.textheld import text_held
        from maskcli.trace.tops import withheld
        from maskcli.trace.loaderbatch import loader_batch
        from maskcli.trace.heldinput import withheld_input

        try:  # (a mask its caller holds and did not hand over: read while the caller's frames are the call's)
            kept = {**withheld(module, args, kwargs, frame.f_back), **text_held(module, args, kwargs, frame.f_back),
                **loader_batch(module, args, kwargs, frame.f_back),  # (a DataLoader's batch: checks/batchaxis.py)
                **withheld_input(module, args, kwargs, frame.f_back)}  # (conditioning never handed: condwithheld.py)
        except (Exception, SystemExit):  # noqa: BLE001 - a program object that cannot be read: nothing read
            kept = {}
        kept["state_writes"] = assigned.WRITES[0]  # (module state assigned so far: checks/continued.py)
        if threading.get_ident() != threading.main_thread().ident:  # (the thread it ran on, as its calls say it:
            kept["thread"] = threading.current_thread().name  # checks/context.Run.top pairs a call with its own thread's)
        local.outer = held = [frame, module, args, kwargs, first, len(self._calls), kept]
        if id(module) not in self._handles:  # (a first call, unhooked: its forward's frame, read as it returned)
            self.__dict__.setdefault("_forwards", {})[id(held)] = _forward(frame, found)
        rewrites(self).begin(id(held), first, module, args, kwargs)  # (its batches' masks as it began: trace/rewritten.py)
        adopt(self, held, found[-1][1])  # (its convolutions before this first attention call: trace/convpad.py)
        self._outers[threading.get_ident()] = held
        if id(module) not in self._handles:  # (this call ends without the hook: finished later, a mask it was handed
            if _masks_handed(module, args, kwargs) or rewrites(self).begun(id(held)):  # changed maybe, and what it
                self.poolrows.watch(frame, lambda value, held=held: self._ended(held, value))  # wrote into its batches: read as
            self.poolrows.first_call(frame, module, args, kwargs, held, self._follow)  # it returns; a profile function
            # runs while it is watched: only where it was handed a mask or a batch)
            self._handles[id(module)] = (module.register_forward_pre_hook(self._outer_pre),
                                         module.register_forward_hook(self._outer_post, always_call=True, with_kwargs=True))
        self.poolrows.inside(found, held, self._follow, self._held_outer, self._handles)  # (its model calls inside: trace/poolrows.py)

    def _held_outer(self):
        """The outermost module call running on this thread (its held list), or None."""
        return self._local.outer

    def _called(self, outermost: tuple) -> tuple:
        """The outermost module call, or the `forward` of a module holding it that the program called directly around it
        (ExLlama's generator calls `model.forward(ids, cache, input_mask=...)`: no module call of the model runs, only
        its layers'), as (module, its frame, variables as _call_impl's), so that the model's call gives the checks its
        arguments and config. Walked once per module call: its answer is kept with that call's frame."""
        inner, frame = outermost[0], outermost[1]
        kept = self.__dict__.get("_called_kept")
        if kept is not None and kept[0] is frame:
            return kept[1]
        found, walk = outermost, frame.f_back
        while walk is not None:
            code = walk.f_code
            # (only a `forward` outside every module call is one called directly: another method around a module
            # call, a LightningModule's training_step, is not the model's call and does not hold its arguments)
            if code.co_name == "forward" and code.co_argcount and not code.co_filename.startswith(_own()):
                module = walk.f_locals.get(code.co_varnames[0])
                if issubclass(type(module), torch.nn.Module) and module is not found[0] and _holds(module, inner):
                    variables = walk.f_locals
                    names = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
                    found = (module, walk, {"self": module, "args": (),
                                            "kwargs": {n: variables[n] for n in names if n in variables}})
            walk = walk.f_back
        self.__dict__["_called_kept"] = (frame, found)
        return found

    def _ended(self, held: list, output=None) -> None:
        """A module's first outermost call returned (its frame's return: no hook of its own ran): what it wrote into the
        batches it was handed (trace/rewritten.py, as _outer_post reads it), and the small tensors it was handed copied
        as they are now, where the call is not finished yet (_finish reads them), with its output's rows hashed."""
        rewrites(self).end(id(held), held[4], self.sites.shown(held[1]))
        if held[0] is not None:
            held[6] = {**(held[6] or {}), **outrows.output_rows(output)}  # (which rows a later memory copies: outrows.py)
            self.__dict__.setdefault("_then", {})[id(held)] = (held, _then(held[2], held[3]))

    def _outer_pre(self, module, args) -> None:
        self.maskmean.forget()
        held = self._local.outer
        if held is not None and held[1] is module:  # its previous call ended without the hook (or a call inside it)
            with self._lock:
                self._finish(held)

    def _outer_post(self, module, args, kwargs, output=None) -> None:
        held = self._local.outer
        if held is not None and held[1] is module:
            rewrites(self).end(id(held), held[4], self.sites.shown(module))  # (as it ends: trace/rewritten.py)
            if held[0] is not None:
                held[6] = {**(held[6] or {}), **outrows.output_rows(output)}  # (its output's rows hashed: outrows.py)
            with self._lock:
                self._finish(held)
            if output is not None and self.poolrows.note(output, module, args, kwargs, held[4], held[5]):
                self._follow()  # (its output read at one position per row: trace/poolrows.py)

    def _finish(self, held: list) -> None:
        """The Top of an outermost module call that made attention calls (what the checks read of it)."""
        frame, module, args, kwargs, first, end, kept = held
        if frame is None:  # (finished already)
            return
        held[0] = None  # (its frame let go: the program's variables are its own again)
        forward = self.__dict__.get("_forwards", {}).pop(id(held), None)
        then = self.__dict__.get("_then", {}).pop(id(held), None)
        if then is not None and then[0] is held:  # (a module's first call, finished after it returned: what it was
            then = then[1]  # handed that the program changed since, as it was when the call returned)
            args, kwargs = tuple(_as_then(v, then) for v in args), {n: _as_then(v, then) for n, v in kwargs.items()}
        convs = self._convs.pop(id(held), ())  # (what its convolutions read: trace/convpad.py)
        if convs:
            stated_frames(convs, module, args, kwargs)  # (the call's own 2-D masks beside them: trace/convpad.py)
        pools = self._pools.pop(id(held), ())  # (the positions its poolings weigh: trace/poolweights.py)
        permuted = self._permuted.pop(id(frame), ())  # (its tokens reordered by a gather: trace/permuted.py)
        for key, value in list(self._outers.items()):
            if value is held:
                del self._outers[key]
        if self._local.outer is held:
            self._local.outer = None
        from maskcli.trace.later import later
        from maskcli.trace.tops import top
        from maskcli.trace.memslots import memory_length
        from maskcli.trace.tables import table_positions

        losses, self._local.losses = getattr(self._local, "losses", None), None  # (its own loss: trace/losses.py)
        where = self.sites.shown(module)
        rewrites(self).drop(id(held))  # (what it was handed, let go where its end was not seen: trace/rewritten.py)
        kept = {**(kept or {}), **table_positions(module, self._local), **memory_length(module)}  # (the rows its
        # table of positions was read at; its memory length as it ran)
        if "output_rows" not in kept and forward is not None:  # (a first call whose return was not seen: its
            kept.update(outrows.returned_rows(forward))  # forward's locals as it returned, outrows.py)
        try:  # (the program's objects read: a config whose attribute access raises must not reach it)
            found = None if losses else later(where, module, args, kwargs, first, end, kept)
            if found is None:  # (made now: its arguments may change behind it; else once the run is over, made())
                found = top(where, module, args, kwargs, first, end, held=kept)
            else:
                self.__dict__["_laters"] = True
        except (Exception, SystemExit):  # noqa: BLE001 - what the call states is then unknown; its calls stay recorded
            self._local.losses = losses  # (kept for the next call's Top, as before it was read)
            return
        stated = self._stated.get(id(module))  # (read once per module: trace/stated.py)
        if stated is not None and stated[0] is module:
            found.stated = stated[1]
        else:  # read once the run is over (settle()), from the frames kept as it was called
            self._pending.append((found, module))
        found.convs, found.pools, found.permuted = tuple(convs), tuple(pools), tuple(permuted)
        self._tops.append(found)
        if losses:
            from maskcli.trace.losses import inside

            inside(found, losses)

    # --- the tops, once the run is over ----------------------------------------------------------

    @property
    def tops(self) -> list:
        """Each outermost module call (maskcli.checks.context.Top), the configs its program states read (settle())."""
        if self._outers:
            with self._lock:
                for held in list(self._outers.values()):
                    self._finish(held)
        self.made()
        if self._pending:
            self.settle()
        self.poolrows.attach(self._tops)
        rewrites(self).attach(self._tops)
        return self._tops

    def settle(self) -> None:
        """Read the configs the pending tops' modules state (trace/stated.py): after the run, not while it runs (a
        tiny model's configs take longer to read than its whole forward). The frames were kept at the call."""
        from maskcli.trace.evictbudget import evict_budgets
        from maskcli.trace.stated import stated

        self.made()  # (the tops that wait first: trace/later.py)
        with self._lock:
            if self._names is None:
                path = self.sites.path
            else:
                names = self._names
                path = lambda module: None if (found := names.get(id(module))) is None else found[1]  # noqa: E731
            budgets = {}  # (a heavy-hitter budget the first forward set, read once a module)
            for top, module in self._pending:
                try:
                    if id(module) not in budgets:
                        budgets[id(module)] = evict_budgets(module, path)
                    top.stated = stated(module, path, self._stated, self._frames.get(id(module))) + budgets[id(module)]
                except (Exception, SystemExit):  # noqa: BLE001 - a config whose attribute access raises: it states nothing maskcli reads
                    top.stated = ()
            self._pending.clear()
            self._frames.clear()
            self._names = None

    def made(self) -> list:
        """The tops so far, each made where it waited to be (trace/later.py: a Top made once the run is over)."""
        if self.__dict__.pop("_laters", False):
            from maskcli.trace.later import Later

            with self._lock:
                tops, made = self._tops, {}
                for i, found in enumerate(tops):
                    if isinstance(found, Later):
                        made[id(found)] = tops[i] = found.make()
                if made:
                    self._tops[:] = [found for found in tops if found is not None]
                    self._pending[:] = [(made.get(id(found), found), module) for found, module in self._pending
                                        if made.get(id(found), found) is not None]
        return self._tops
