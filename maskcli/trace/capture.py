"""Recording the attention calls of a running program: torch's attention entry points patched, and the calls' masks.

The few torch functions that are attention (SDPA, MHA's functional form, a softmax over scores), or start what
the trace follows (q @ kᵀ, a cast or a sum), are wrapped where they are entered (entry.py); the rest of torch runs
untouched, and a TorchFunctionMode is on only while a followed tensor is alive (mode.py). An attention call's mask
is read before the function runs exactly as it was called, and its result returned untouched. FlexAttention's
`flex_attention` is wrapped in torch's module and wherever a loaded module holds it (patch.py swaps its code);
flash_attn's functions are swapped the same way, and Hugging Face's AttentionInterface lookups return wrapped
functions (interface.py), when the program has imported them or as soon as it does. Where a call came from is read
from the frames at the call (the modules whose calls are running: sites.running), not from hooks on every module;
only the outermost modules that made calls get hooks of their own, for what the checks read of each of their calls.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F

import maskcli.trace.masks as readers
import maskcli.trace.queried as queried, maskcli.trace.layerkinds as layerkinds  # (GPT-Neo's local layers)
import maskcli.trace.calledflag as calledflag, maskcli.trace.askedcausal as askedcausal
import maskcli.trace.padfill as padfill, maskcli.trace.namedmasks as namedmasks
import maskcli.trace.offgrid as offgrid, maskcli.trace.rotated as rotated, maskcli.trace.positionsat as positionsat
import maskcli.trace.poolspan as poolspan, maskcli.trace.padend as padend  # (the last: samples beside a held mask)
import maskcli.trace.convpad as convpad, maskcli.trace.linearattn as linearattn  # (Σ φ(k) vᵀ: no softmax)
from maskcli.trace.masks import Call, Operands
from maskcli.trace.follow import Follow, Local as _Local, Traced as _Traced, said as _said
from maskcli.trace.outer import Outer
import maskcli.trace.flash as flash
import maskcli.trace.compiled as compiled
import maskcli.trace.interface as interface
import maskcli.trace.keyreads as keyreads
import maskcli.trace.vllm as vllm_capture
from maskcli.trace.flex import flex as read_flex
import maskcli.trace.entry as entry
from maskcli.trace.mode import Mode, has_values
from maskcli.trace.patch import Watch, swap
from maskcli.trace.overflow import WATCHED
from maskcli.trace.discarded import FILLS as DISCARDED
from maskcli.trace.apis import APIS, checked as checked_apis
from maskcli.trace.heldchunks import held_chunks
from maskcli.trace.scores import MATMULS, Scores, banded as banded_scores
from maskcli.trace.sites import Sites, guarded, running, walk
from maskcli.trace.singleton import Singles, read as read_singleton
from maskcli.trace.stated import outside
from maskcli.trace.store import read_calls, store
from maskcli.trace.threads import Threads
from maskcli.trace.packed import documents, handed, held_by

DEFAULT_MAX_BYTES = 256 << 20

ROUTING = frozenset({"mlp", "gate", "router", "moe", "experts", "feed_forward", "ffn"})  # a module path's words


class Trace(Outer, Follow):
    """`with Trace() as t: ...` records every attention call in t.calls; each distinct mask is kept once in t.masks."""

    def __init__(self, apis=None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.apis = APIS if apis is None else checked_apis(apis)  # (names it records, one line where not: apis.py)
        self.max_bytes = max_bytes
        self._calls: list[Call] = []  # (t.calls: its masks read first where copies of them wait: store.read_unread)
        self._masks: dict[str, dict] = {}
        self._unread: dict = {}  # placeholder key -> (a mask's copy, its shape, the call's): read after the run (store.py)
        self._read: dict = {}  # placeholder key -> its digest once read; _contents: a copy's content -> its digest; the
        # calls before _fixed hold no placeholder (but those in _late, whose mask changed after they were recorded)
        self._contents, self._unread_bytes, self._fixed, self._late = {}, 0, 0, []
        self.bytes = 0
        self._local = _Local()  # busy, within, interfaces, the mode: each thread the program runs has its own
        self._lock = threading.RLock()
        self.readers = readers.watched(self)  # (the loss: what it states, no call recorded: trace/losses.py)
        # id(an outermost module call held) -> what its convolutions read (convpad.py), the positions its poolings weigh
        self._convs, self._pools, self._permuted = {}, {}, {}  # (poolweights.py); id(a frame) -> its tokens' reorderings (permuted.py)
        if "sdpa" in self.apis:
            self.readers[entry.sdpa()] = readers.sdpa
        if "mha" in self.apis:
            self.readers[F.multi_head_attention_forward] = readers.mha
        self.scores = None  # the tensors that are q @ kᵀ scores (scores.py): a softmax over logits is no attention call
        if "softmax" in self.apis:
            for func in (torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax):
                self.readers[entry.canonical(func)] = readers.softmax  # (the functions themselves, in a trace in a trace)
            self.scores = Scores()
        from maskcli.trace.maskmean import REDUCES
        from maskcli.trace.weights import Weights

        self.weights, self.rotations = Weights(), rotated.Rotations()  # (a softmax's weights: weights.py; rotary factors)
        if self.scores is not None:
            self.readers[torch.exp] = self.readers[torch.Tensor.exp] = readers.exp_reader(self.scores, self.weights)
            from maskcli.trace.pointwise import ACTIVATIONS, activation_reader
            for func, name in ACTIVATIONS.items():  # (silu(q @ kᵀ): HSTU's attention, no softmax)
                self.readers[entry.canonical(func)] = activation_reader(self.scores, self.weights, name)
            self.readers[torch.einsum] = linearattn.read  # (a linear attention's Σ φ(k) vᵀ over every key)

        self._softmax = None  # (the (call, seen) of the softmax just recorded, for the mode to follow its output)
        self.singles = Singles()  # (the lines that softmax one element, and whether over more too: singleton.py)
        # the torch functions the mode looks at whatever runs: the rest only while a tensor it follows is alive
        self.watched = frozenset({*self.readers, *WATCHED, *REDUCES, *entry.GATHERS,
                                  *((*MATMULS, *DISCARDED) if self.scores is not None else ())})
        self._followers()  # (what the mode follows beside the scores and weights: follow.py)
        self.sites = Sites()
        self._tops: list = []  # maskcli.checks.context.Top: each outermost module call, its config and arguments
        self._pending: list = []  # (Top, module): tops whose configs are read once the run is over (settle())
        self._frames: dict = {}  # id(module) -> the program's frames at its first call (stated.frames), until settled
        self._names = None  # the sites' module names, kept past the trace's end until the pending tops are settled
        self._cache: dict = {}
        self._held: dict = {}  # each shape tuple and word the calls hold, once (equal values: one object)
        self._stated: dict = {}  # id(outermost module) -> (module, the configs it states: trace/stated.py)
        self._loose = {}  # call site -> outside()
        self._handles: dict = {}  # id(outermost module) -> its hooks' handles (_outer_pre, _outer_post)
        self._outers: dict = {}  # thread id -> _Local.outer of that thread, until finished (_finish)
        self._entries: list = []
        self.mode_for_compile = Mode(self)  # (the mode dynamo inlines where compiled code calls attention: compiled.py)
        self._unwrap: list = []
        self._undo: list = []  # what puts swapped functions and patched classes back, in the order done
        self._swapped: set[int] = set()
        self.vllm = vllm_capture.Recorder(lambda: self.active and not self.busy)  # where vLLM is imported: its batches
        self.patched: set[str] = set()  # "flash", "hf", "vllm": the APIs whose modules the program imported (so were patched)
        self.active, self.threads = False, None
        self.sink_keys = lambda: None  # keys of the call running now, where a learned sink's module has no interface frame
        self.compiled = compiled.Compiled(lambda: self.within > 0, self)  # calls of torch.compile'd code (not those a
        # recorded call runs itself: flex_attention compiles its operator even in eager); their attention a graph break

    @property
    def calls(self) -> list[Call]:
        """Every attention call recorded, in order (the masks copied at the calls read first: store.read_calls)."""
        self._read_copies()
        return self._calls

    @property
    def masks(self) -> dict[str, dict]:
        """Each distinct mask once, by its digest (tracefile's stored form)."""
        self._read_copies()
        return self._masks

    def _read_copies(self) -> None:
        if (self._unread or self._late or self._read and self._fixed < len(self._calls)) and not self._local.busy:
            read_calls(self)

    @property
    def busy(self) -> bool:
        """Recording a call now (what maskcli itself runs then is not the program's)."""
        return getattr(self._local, "busy", False)

    @busy.setter
    def busy(self, value: bool) -> None:
        self._local.busy = value

    @property
    def within(self) -> int:
        """Inside a call recorded already (a module read from its arguments, a swapped function): its inner calls
        are not new ones."""
        return getattr(self._local, "within", 0)

    @within.setter
    def within(self, value: int) -> None:
        self._local.within = value

    @property
    def mode(self):
        """This thread's Mode (None until it is first needed)."""
        return self._local.mode

    @property
    def interfaces(self) -> list[dict]:
        """The Hugging Face interface calls running in this thread (interface.py), innermost last."""
        found = getattr(self._local, "interfaces", None)
        if found is None:
            found = self._local.interfaces = []
        return found

    def groups(self) -> list:
        """The calls grouped by mask, API and shape, each named, with findings (maskcli.trace.report.Group): those
        made where a mask is named, and those of the rules that read the run (maskcli.checks)."""
        from maskcli.checks.engine import apply
        from maskcli.checks.context import Run
        from maskcli.trace.report import group

        return apply(group(self.calls, run=(run := Run(self.calls, self.tops))), run)  # (the run's padding: rows.py)

    def report(self) -> str:
        """The grouped report as plain text, one line per group and one per finding."""
        from maskcli.trace.report import text

        return "\n".join([text(self.groups(), len(self.calls)), *self.notes()])

    def notes(self) -> list[str]:
        """What the trace could not see, or saw beyond the main thread: threads, child processes, compiled code."""
        return (self.threads.notes(self.calls) if self.threads is not None else []) + self.compiled.notes()

    # --- entering and leaving -----------------------------------------------------------------

    def __enter__(self) -> Trace:
        if "flex" in self.apis:
            self._patch_flex()
        from maskcli.trace.modules import wrap

        self._unwrap = wrap(self, record="mha" in self.apis)  # always: the mode must not take their fast paths away
        self._watch = Watch(self._wanted).__enter__()
        loaded = [name for name in (interface.MODULE, *flash.MODULES, compiled.MODULE, vllm_capture.MODULE) if name in sys.modules]
        if "flash_attn" in loaded:  # its submodules too (not a walk of every module loaded: thousands, with transformers)
            loaded += [name for name in list(sys.modules) if name.startswith("flash_attn.")]
        for name in loaded:  # what the program imported already; the watch sees what it imports later
            found = self._wanted(name) if sys.modules.get(name) is not None else None
            if found is not None:
                found(sys.modules[name])
        self._entries = entry.patch(self)
        self._undo.append(convpad.patch(self))  # (what a convolution reads of padded frames: trace/convpad.py)
        self._local.traced = True
        self.active = True
        self.threads = Threads(lambda: _Traced(self) if self.active else None).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.threads.__exit__()
        with self._lock:
            for held in list(self._outers.values()):
                self._finish(held)
        self._leave_thread()
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()
        for put_back in self._entries:
            put_back()
        self._entries = []
        self._local.traced = False
        from maskcli.trace.modules import unwrap

        unwrap(self._unwrap)
        self._unwrap = []
        self._watch.__exit__()
        self.active = False
        while self._undo:
            self._undo.pop()()
        self._swapped.clear()
        self._cache.clear()
        keyreads.forget()  # (buffer addresses and keys read are this trace's: the next one's may be freed and made again)
        if self._pending:  # (the names the pending tops' configs are read by: settle())
            self._names = dict(self.sites._names)
        self.sites.clear()

    def _patch_flex(self) -> None:
        """flex_attention's own code swapped for a shim that records the call first (patch.swap)."""
        import torch.nn.attention.flex_attention as flex_module

        undo = swap(flex_module.flex_attention, lambda original: self._hook(read_flex, original))
        if undo is not None:  # (not a plain function in some torch: then its calls go unseen, as compiled ones do)
            self._undo.append(undo)

    def _wanted(self, name: str):
        """What to do once module `name` is loaded: swap flash_attn's functions, or patch HF's AttentionInterface."""
        if "flash" in self.apis and flash.watched(name):
            return lambda module: flash.patch(self, module)
        if "hf" in self.apis and name == interface.MODULE:
            return self._patch_hf
        if "vllm" in self.apis and name == vllm_capture.MODULE:
            return lambda module: (self._undo.append(self.vllm.patch(module)), self.patched.add("vllm"))
        if name == compiled.MODULE:
            return self._patch_compiled
        return None

    def _patch_compiled(self, module) -> None:
        undo = self.compiled.patch(module)
        if undo is not None:
            self._undo.append(undo)

    def _patch_hf(self, module) -> None:
        self.patched.add("hf")
        undo = interface.patch(self, module)
        self._undo.append(lambda: interface.unpatch(undo))

    def _hook(self, reader, original, inner: bool = True):
        """The function a swapped one runs: the call recorded, then the original run as called; with `inner`, the
        attention calls it makes itself (a stand-in's softmax) are its own, not new ones."""

        def hook(*args, **kwargs):
            if torch.compiler.is_dynamo_compiling() or self.busy or self.within:
                return original(*args, **kwargs)
            made = len(self._calls)  # (not self.calls: that property reads every mask still waiting)
            self.capture(reader, args, kwargs)
            self.within += inner
            try:
                return original(*args, **kwargs)
            except BaseException as error:
                self.refused(made, error)
                raise
            finally:
                self.within -= inner

        return hook

    def refused(self, made: int, error: BaseException) -> None:
        """The call recorded at `made` raised: the kernel refused it (is_causal=2, shapes apart), no attention ran."""
        if len(self._calls) > made:
            self._calls[made].details["raised"] = f"{type(error).__name__}: {_said(error)}"

    # --- recording ----------------------------------------------------------------------------

    def _capture(self, reader, args, kwargs) -> None:
        """Record one call (Follow.capture runs this, and keeps whatever goes wrong here from the program)."""
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
        if first is not None and not has_values(first):
            return  # inside vmap, or shapes without values (meta, fake): no mask to read, nothing run for real
        found = running((frame := sys._getframe(1)), (walked := walk(frame)).calls)  # modules running (walk.py)
        self.busy = True
        sites = self.sites
        try:
            with self._lock:  # (threads of the program record one at a time: indexes, steps and the store stay whole)
                made = len(self._calls)
                sites.load([module for module, _, _ in reversed(found)], walked, [frame for _, frame, _ in reversed(found)])
                try:
                    self._record(reader, args, kwargs)
                    if len(self._calls) > made and found:
                        for _, _, variables in found[:-1]:  # documents handed to an inner module (innermost first)
                            given = handed(variables)
                            if given is not None:
                                documents(self._calls, made, *given)
                        documents(self._calls, made, held_by(walked))  # (those its attending function holds itself)
                        self._outer(found, made)
                finally:
                    sites.unload()
        finally:
            self.busy = False

    def _record(self, reader, args, kwargs) -> None:
        site, where = keyreads.at(*self.sites.current())  # (the site keys are compared within: keyscale.py)
        caller = site[2] if site[0] == "line" else None
        site = site if caller is None else site[:2]  # steps count per function line, wherever it was called from
        grad = torch.is_grad_enabled()
        try:
            torch._C._set_grad_enabled(False)  # (torch.no_grad() as a context costs more than the two calls)
            if reader in (readers.softmax, read_singleton) and not ROUTING.isdisjoint(where.split(".")) \
                    and not self.scores.has(readers.softmax_input(args, kwargs)):
                return  # a softmax in a module the program names an MLP, router or gate, over no q @ kᵀ it made: a
                # mixture-of-experts router's (tokens x experts, square only by chance: Zaya's 5 router classes)
            seen = reader(args, kwargs)
            if seen is None or seen.api == "softmax" and banded_scores(seen.q, self.sites.stack) \
                    and not self.scores.has(readers.softmax_input(args, kwargs)):
                return  # (no call, or banded scores: no query-by-key mask to read, scores.py)
            overflowed = self.overflows.of(args, kwargs, seen.api)
            if overflowed is not None:  # a fill that became -inf on its way here, or a bool added (checks/dtypes.py)
                seen.details["bool_added" if overflowed["op"] == "bool" else "overflow"] = overflowed
            self.sites.note(seen.details, caller, seen.shape)
            # each reader of the frames guarded alone (sites.guarded: a raising __class__ leaves its detail out, not the call)
            for note in (queried.note, layerkinds.note):  # (the layer's queries, heads; GPT-Neo's local layers)
                guarded(note, seen.details, self.sites.stack, seen.api, seen.shape, self.sites.walked)
            guarded(calledflag.note, seen.details, self.sites.stack, self.sites.walked, seen.shape)  # (a helper's causal=)
            guarded(askedcausal.note, seen.details, self.sites.stack, self.sites.walked)  # (mask="subsequent" per call)
            for note in (padfill.note, namedmasks.note, offgrid.note, poolspan.note, padend.note, self.rowsout.note):
                guarded(note, seen.details, self.sites.walked)  # (fill flags, `x_mask`s, positions, a row mask...)
            guarded(rotated.note, seen.details, self.rotations, self.sites.walked, seen.shape)  # (and ropeat's: positioned.py)
            guarded(positionsat.note, seen.details, self.sites.walked, seen.shape, self._held_outer())  # (cachedpositions.py)
            chunks = held_chunks(self.sites.walked.held) if self.sites.walked is not None else None
            if chunks is not None:  # (a streaming encoder's chunk config its frames hold: checks/chunkleft.py)
                seen.details["held_chunks"] = chunks
            frames = self.interfaces
            if frames and seen.api == "sdpa":  # HF's sdpa may have packed GQA heads as query rows
                interface.unpack_gqa(seen, frames[-1])
            elif seen.api == "softmax":  # a learned sink logit is no key (GPT-OSS): cut here, once, before it is stored
                interface.leave_out_sink(seen, frames[-1].get("sink_keys") if frames else self.sink_keys() or self.scores.sink(readers.softmax_input(args, kwargs)))
            key = readers.stored(self, seen)  # (self._store, and a mask the frames handed the call: trace/given.py)
        except (Exception, SystemExit) as error:  # a call maskcli cannot read is still a call: say so and carry on
            if not getattr(reader, "records", True):  # (a reader of what the program states records none: its tables)
                return
            self._append(Call(getattr(reader, "api", "?"), (0, 0, 0, 0), (), (), (), "", "", index=len(self._calls), where=where, step=self.sites.step(site),
                              details={"error": f"{type(error).__name__}: {_said(error)}"}, trace=self))
            return
        finally:
            torch._C._set_grad_enabled(grad)
        if seen.child:
            site, where = self.sites.current(seen.child)
        held = self._held  # (a million calls are a million records: their shapes and words kept once, details compact)
        shape, q, k, v, where = (held.setdefault(x, x) for x in (tuple(map(int, seen.shape)), seen.q, seen.k, seen.v, where))
        self._append(Call(seen.api, shape, q, k, v, held.setdefault(seen.dtype, seen.dtype), held.setdefault(seen.device, seen.device),
                          index=len(self._calls), where=where, step=self.sites.step(site), mask=key, details=dict(seen.details), trace=self))
        self._softmax = (self._calls[-1], seen) if seen.api == "softmax" else self._softmax
        self.discarded.kernel(self._calls[-1], args, kwargs)  # (an SDPA attn_mask filled, the fill thrown away: discarded.py)
        if not self.sites.stack:  # a call outside any module: what the program's frames state for it, and the
            documents(self._calls, len(self._calls) - 1, self.sites.held)  # cu_seqlens its function holds (HunyuanVideo's)
            if self._local.outer is not None:  # (the module call this thread made calls in has ended: its Top first)
                self._finish(self._local.outer)
            outside(self.made(), where, len(self._calls) - 1, self._loose)

    def _append(self, call: Call) -> None:
        """A call made inside a Hugging Face interface call carries what HF told that call (and is what it did)."""
        if threading.get_ident() != threading.main_thread().ident:  # (current_thread() costs a lookup a call)
            call.details["thread"] = threading.current_thread().name
        if self.compiled.inside():
            call.details["compiled"] = True
            self.compiled.seen += 1
        frames = self.interfaces
        if frames:
            interface.made_in(call, frames[-1])
        self._calls.append(call)

    def _store(self, seen) -> str:
        return store(self, seen)  # (trace/store.py: once per digest, a mask given again unchanged not read again)

