"""The outermost module calls that made attention calls, read from the frames at a call and finished as they end.

No hook runs on every module call: at an attention call the frames say which module calls are running
(sites.running); the outermost one is held, and its module gets hooks of its own so that its later calls are
finished as they end (what the checks read of each: tops.py). A trace mixes this in (capture.py).
"""

from __future__ import annotations

import threading


class Outer:
    """Trace's outermost module calls (capture.py's Trace mixes this in)."""

    # --- where a call comes from --------------------------------------------------------------

    def _outer(self, found: list, first: int) -> None:
        """Call `first` (and any after it) was made inside the outermost module call `found[-1]` (sites.running): that
        call held until it is finished (_finish), and its module hooked so that its later calls are finished as they
        end (a module's hooks are read as its call begins: this call ran without them)."""
        local, (module, frame, variables) = self._local, found[-1]
        held = local.outer
        if held is not None and held[0] is frame:
            held[5] = len(self._calls)
            return
        if held is not None:
            self._finish(held)
        if id(module) not in self._frames and not (id(module) in self._stated and self._stated[id(module)][0] is module):
            from maskcli.trace.stated import frames

            self._frames[id(module)] = frames(frame=frame.f_back)  # (the program's frames as the module was called)
            from maskcli.trace.tokenizer import tokenizer

            try:  # (tops.py reads it once the call is finished, maybe after the run: the frames are the call's now)
                tokenizer(module, frame.f_back)
            except Exception:  # noqa: BLE001 - a program object that cannot be read: no tokenizer read
                pass
        args, kwargs = variables.get("args", ()), variables.get("kwargs", {})
        from maskcli.trace.tops import withheld

        try:  # (a mask its caller holds and did not hand over: read while the caller's frames are the call's)
            kept = withheld(module, args, kwargs, frame.f_back)
        except Exception:  # noqa: BLE001 - a program object that cannot be read: nothing read
            kept = {}
        local.outer = held = [frame, module, args, kwargs, first, len(self._calls), kept]
        self._outers[threading.get_ident()] = held
        if id(module) not in self._handles:
            self._handles[id(module)] = (module.register_forward_pre_hook(self._outer_pre),
                                         module.register_forward_hook(self._outer_post, always_call=True, with_kwargs=True))

    def _outer_pre(self, module, args) -> None:
        held = self._local.outer
        if held is not None and held[1] is module:  # its previous call ended without the hook (or a call inside it)
            with self._lock:
                self._finish(held)

    def _outer_post(self, module, args, kwargs, output=None) -> None:
        held = self._local.outer
        if held is not None and held[1] is module:
            with self._lock:
                self._finish(held)

    def _finish(self, held: list) -> None:
        """The Top of an outermost module call that made attention calls (what the checks read of it)."""
        frame, module, args, kwargs, first, end, kept = held
        if frame is None:  # (finished already)
            return
        held[0] = None  # (its frame let go: the program's variables are its own again)
        for key, value in list(self._outers.items()):
            if value is held:
                del self._outers[key]
        if self._local.outer is held:
            self._local.outer = None
        from maskcli.trace.tops import top

        try:  # (the program's objects read: a config whose attribute access raises must not reach it)
            found = top(self.sites.shown(module), module, args, kwargs, first, end, held=kept)
        except Exception:  # noqa: BLE001 - what the call states is then unknown; its calls stay recorded
            return
        stated = self._stated.get(id(module))  # (read once per module: trace/stated.py)
        if stated is not None and stated[0] is module:
            found.stated = stated[1]
        else:  # read once the run is over (settle()), from the frames kept as it was called
            self._pending.append((found, module))
        self._tops.append(found)
        losses, self._local.losses = getattr(self._local, "losses", None), None  # (its own loss: trace/losses.py)
        if losses:
            from maskcli.trace.losses import inside

            inside(found, losses)
