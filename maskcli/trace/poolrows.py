"""Where a program reads one position per batch row of its model's output: the position each row is pooled at.

An embedder built on a decoder pools each row's last token (`last_hidden_state[arange(B), attention_mask.sum(1) - 1]`,
`[:, -1]`, a `gather` along the positions); an encoder pools its first (`[:, 0]`). Where the batch is padded, the
program states which positions are its rows' tokens: the `attention_mask` it handed the model call. So each outermost
call whose output states a (B, L, D) `last_hidden_state` (or `hidden_states`, each layer's), handed a (B, L)
`attention_mask` with padding in it, has that tensor followed (weakly, the mode on only while it lives) until it is
indexed with one position per row: an int or slice-free index on the positions (`[:, -1]`), a pair of index tensors,
`gather(1, ...)`, or its rows one at a time (`for row in output: row[-1]`, `output[i][-1]`), and no longer once it
was (the mode on all the while would make an embedder's loop 1.4 times slower). The rows and positions read, with
that mask, are kept on the call's Top (`pooled`), which checks/pooledat.py holds against the mask. A language model's
(B, L, V) `logits` are followed the same way where its output states no `last_hidden_state` (ms-swift's reranker's
`logits[:, -1]`), save where the call is a decoder's over another sequence (an encoder-decoder's, `decoder_*` inputs)
or is handed `labels` (its loss is its own, over every position). A model call made inside the outermost one
(sentence-transformers' Sequential calls its Transformer module, which calls the model, and Pooling reads
`token_embeddings[:, 0]` before the Sequential returns) is followed the same way (`inside`), under its own class.

Also followed: a model's output handed back bare, (B, L, D), or first in a tuple (return_dict=False; a hand-written
model's `(x, attn)`), and a head computed of a followed output position by position (`linear`, `squeeze`, a cast: a
reward or value head's (B, L) scores), read one cell at a time too (`values[i, j]` in a loop over the rows:
torchrl#3887's end scores, read at the last column of a right-padded batch). A model call handed no attention_mask
states its padding by its ids against the pad id the model states (RecBole's BERT4Rec, `nn.Embedding(padding_idx=0)`
and `item_seq != 0`; not where that id is also its eos).
"""

from __future__ import annotations

import sys
import weakref
from typing import NamedTuple

import numpy as np
import torch

from maskcli.trace.poolread import CELL, _gathered, _indexed, _lead, _stacked
from maskcli.trace.unseen import unseen

MOST = 4096  # rows x positions of the mask kept at most
HEADS = frozenset({"linear", "squeeze", "float", "to"})  # position by position: a head over a followed output
NORMS = frozenset({"layer_norm", "rms_norm"})  # position by position, the output's own shape: the output still
SCALED = frozenset({"mul", "__mul__", "__rmul__", "add", "__add__", "__radd__"})  # the output times a factor (or plus
# a bias: a reward head's `gain * r + bias`) of its own shape or broadcast to it
ADDED = -5e3  # an additive mask's value at or below which a key is masked: (1 - mask) * -10000 (old GPT-2's, PanGu's)


class RowOf(NamedTuple):
    """One row of a followed output (handed out alone), and where it sits in it."""
    row: int  # its batch row
    parent: int  # id of the output it is a row of
    rows: int  # the output's batch rows
    head: bool  # the output is a head computed over the model's
    offset: int = 0  # its first position among the output's (a slice of the row)
    sliced: bool = False


class PoolRows:
    def __init__(self) -> None:
        self._found: dict = {}  # id(last_hidden_state) -> (weakref to it, its call's record)
        self.records: dict = {}  # (first, end) of an outermost call's calls -> {"mask", "reads"}
        self.inner: dict = {}  # first call of an outermost call -> the records of model calls made inside it
        self._seen: set = set()  # ids of the inner modules looked at (hooked where handed a (B, L) mask)
        self._watched: dict = {}  # frame of a running module call -> what to call as it returns
        self.outer = lambda: None  # the running outermost call's held list on this thread (inside() is handed it)

    def note(self, output, module, args: tuple, kwargs: dict, first: int, end: int | None) -> bool:
        """Follow the `last_hidden_state` of an outermost call's `output` where the call was handed padding over it;
        whether it is followed. `end` None: a model call inside the outermost call that began at `first` (inner()).
        Nothing raised reaches the program."""
        try:
            hidden, what = _hidden(output, kwargs)
            if hidden is None:
                return False
            with unseen():  # (maskcli's own reads: no mode, no subclass of the program's sees them)
                mask = _mask(module, args, kwargs)
                if not _padded(mask) or tuple(mask.shape) != _lead(hidden):
                    return False
                source, said = getattr(mask, "stated_by", None), getattr(mask, "said", None)
                mask = mask.detach().cpu().numpy() != 0
            kept = self.inner.setdefault(first, []) if end is None else self.records.setdefault((first, end), [])
            for hidden, what in ((hidden, what), *_states(output, hidden)):
                record = {"mask": mask, "reads": [], "what": what, "source": source, "said": said,
                          "module": type(module).__name__ if end is None else None}
                kept.append(record)
                self._follow(hidden, record)
            return True
        except (Exception, SystemExit):  # noqa: BLE001 - the program's output stays its own
            return False

    def first_call(self, frame, module, args: tuple, kwargs: dict, held: list, follow) -> None:
        """A module's first outermost call, hooked as it runs (its forward hook does not run for it): where it was handed
        padding, its frame's return is watched (a profile function on this thread, until that frame returns: once a
        model) and its output noted as the hook would."""
        try:
            with unseen():  # (maskcli's own reads: no mode, no subclass of the program's sees them)
                if not _padded(_mask(module, args, kwargs)):
                    return
        except (Exception, SystemExit):  # noqa: BLE001 - the program's arguments stay its own
            return
        self._watch(frame, (module, args, kwargs, held, follow, False))

    def inside(self, found: list, held: list, follow, current, handles: dict) -> None:
        """The model calls running inside an outermost one (sites.running's `found`, innermost first, the outermost last)
        that were handed a (B, L) `attention_mask`: a pipeline's encoder (sentence-transformers' Transformer module
        calls its model, and Pooling reads `token_embeddings[:, 0]` before the outermost call returns). Each such module
        is hooked once (its later calls noted as they end); the call running now, where it was handed padding, is
        watched to its return as first_call watches one. Modules looked at once each: a set lookup per attention call.
        `current()`: the outermost call's held list running on this thread when a hooked call ends; `handles`: the
        trace's hooks, removed as it ends."""
        from maskcli.trace.positionsat import _library  # (code no program wrote: an installed package's)

        self.outer = current
        for at, (module, frame, variables) in enumerate(found[1:-1], start=1):
            if id(module) in self._seen or module is held[1]:
                continue
            self._seen.add(id(module))
            if _layer(module, found[at + 1][0]):
                continue  # (a block of a ModuleList, a decoder's layer: its output is the next layer's input, no model
                # call a program pools; followed, it kept the mode on over the rest of every forward)
            args, kwargs = variables.get("args", ()), variables.get("kwargs", {})
            try:
                with unseen():
                    mask = _mask(module, args, kwargs)
                    if type(mask) is not torch.Tensor or mask.dim() != 2 or getattr(mask, "keys_kept", False) \
                            and _library(getattr(getattr(type(module).forward, "__code__", None), "co_filename", "<")):
                        continue  # (an expanded key mask a library's model hands its own encoder: its pooler's
                        # read, BERT's `[:, 0]` of a left-padded batch, is the library's, unread by the program)
                    padded = _padded(mask)
            except (Exception, SystemExit):  # noqa: BLE001 - the program's arguments stay its own
                continue
            handles[("inner", id(module))] = (module.register_forward_hook(
                lambda called, args, kwargs, output, follow=follow: self._inner_post(called, args, kwargs, output, follow),
                with_kwargs=True),)
            if padded:
                self._watch(frame, (module, args, kwargs, held, follow, True))

    def _inner_post(self, module, args: tuple, kwargs: dict, output, follow) -> None:
        held = self.outer()
        if held is None or held[1] is module or held[0] is None:
            return  # (called as the outermost: its own hook notes it)
        if self.note(output, module, args, kwargs, held[4], None):
            follow()

    def watch(self, frame, then) -> None:
        """`frame`'s return watched, `then(value returned)` called as it returns (one profile function for every frame
        watched on this thread; none where the program set a profile of its own)."""
        if not self._watched and sys.getprofile() is not None:
            return
        self._watched.setdefault(frame, []).append(then)
        if len(self._watched) > 1 or len(self._watched[frame]) > 1:
            return
        watched = self._watched

        def profile(called, event: str, arg) -> None:
            if event != "return" or called not in watched:
                return
            thens = watched.pop(called)
            if not watched:
                sys.setprofile(None)
            for then in thens:
                try:
                    then(arg)
                except (Exception, SystemExit):  # noqa: BLE001 - nothing of the trace may reach the program
                    pass

        sys.setprofile(profile)

    def _watch(self, frame, what: tuple) -> None:
        module, args, kwargs, held, follow, inner = what

        def then(value) -> None:
            if self.note(value, module, args, kwargs, held[4], None if inner else held[5]):
                follow()

        self.watch(frame, then)

    def attach(self, tops: list) -> None:
        """Each record with reads onto its call's Top (`pooled`: the mask and the reads)."""
        if not self.records and not self.inner:
            return
        for top in tops:
            records = [*self.inner.get(getattr(top, "first", None), ()),
                       *self.records.get((getattr(top, "first", None), getattr(top, "end", None)), ())]
            pooled = [{**read, "mask": record["mask"], "what": record["what"], "module": record["module"],
                       "source": record.get("source"), "said": record.get("said")}
                      for record in records if record is not None for read in record["reads"]]
            if pooled and hasattr(top, "pooled"):
                top.pooled = pooled

    def after(self, func, args: tuple, kwargs: dict, out=None) -> None:
        """Record the position each row is read at, where `func` indexes a followed output; a head computed of it
        position by position (a linear layer over its last axis, that axis squeezed: a reward model's value head,
        (B, L, D) -> (B, L)) followed on as the same output."""
        name = getattr(func, "__name__", "")
        given = args[0] if args else None
        if name in SCALED and len(args) == 2 and id(given) not in self._found:
            given = args[1]  # (`mask * output`: the output second)
        held = self._found.get(id(given))
        if held is None or held[0]() is not given:
            return
        try:
            if held[2:3] == ("row",):  # (one row of a followed output, `for row in output` or `output[i]`: its read)
                self._read_row(name, args, given, held[1], held[3], out)
                return
            if name == "unbind" and (args[1] if len(args) > 1 else kwargs.get("dim", 0)) == 0 and isinstance(out, tuple) \
                    or name == "__getitem__" and len(args) > 1 and type(args[1]) is int and type(out) is torch.Tensor:
                self._rows(given, held, out, args[1] if name == "__getitem__" else None)
                return
            if given.dim() == 4:  # ((B, 1, L, D) squeezed to (B, L, D): the same output, PanGu's `squeeze(1)`; no other
                if name == "squeeze" and type(out) is torch.Tensor and out.dim() == 3:  # read of it is followed)
                    self._follow(out, *held[1:])
                return
            if name in NORMS or name in SCALED:  # (a final norm over the output, or the output times its mask, position
                # by position: the same output, CLIP's final_layer_norm, sentence-transformers' `token_embeddings *
                if type(out) is torch.Tensor and out.shape == given.shape:  # input_mask_expanded` before their pooling)
                    self._follow(out, *held[1:])
                return
            if name in HEADS:
                if type(out) is torch.Tensor and out.dim() >= 2 and out.shape[:2] == given.shape[:2] \
                        and out.is_floating_point():
                    self._follow(out, held[1], "head")
                return
            self._read(func, args, kwargs, given, held[1], held[2:3] == ("head",))
        except (Exception, SystemExit):  # noqa: BLE001 - what the other followers read of this call is read still
            pass

    def _follow(self, tensor: torch.Tensor, *held) -> None:
        """Follow `tensor` (weakly: let go as it is freed) with what is known of it: its record, and how it was made."""
        key = id(tensor)
        self._found[key] = (weakref.ref(tensor, lambda _, key=key, found=self._found: found.pop(key, None)), *held)

    def _rows(self, given: torch.Tensor, held: tuple, out, at: int | None) -> None:
        """Each row a followed output hands out (`unbind(0)`, as iterating it does; `output[i]`) followed as its row."""
        rows = given.shape[0]
        for row, tensor in (enumerate(out) if at is None else ((at % rows, out),) if -rows <= at < rows else ()):
            if type(tensor) is torch.Tensor and tensor.shape == given.shape[1:]:
                self._follow(tensor, held[1], "row", RowOf(row, id(given), rows, held[2:3] == ("head",)))

    def _read_row(self, name: str, args: tuple, row: torch.Tensor, record: dict, of: "RowOf", out=None) -> None:
        """A row of a followed output read at one position (`row[p]`, `row[p, :]`): its pooling (repeng's `[-1, :]`);
        a slice of it (`row[start:end]`, DeepSpeed-Chat's truncated reward) followed as the row from `start` on."""
        index = args[1] if name == "__getitem__" and len(args) > 1 else None
        at = index[0] if isinstance(index, tuple) and index and all(i == slice(None) for i in index[1:]) else index
        if isinstance(at, slice) and at.step is None and type(out) is torch.Tensor and out.dim() == row.dim():
            span = range(row.shape[0])[at]
            if len(span) and out.shape[0] == len(span):  # (its reads said `of a slice of each row`)
                self._follow(out, record, "row", of._replace(offset=of.offset + span.start, sliced=True))
        elif type(at) is int and -row.shape[0] <= at < row.shape[0]:
            self._found.pop(id(row), None)
            how = f"[{at}] of {'a slice of ' if of.sliced else ''}each row"
            self._kept(record, (np.array([of.row]), np.array([of.offset + at % row.shape[0]]), how), of.head, of.parent,
                       of.rows, cell=True)

    def _read(self, func, args: tuple, kwargs: dict, given: torch.Tensor, record: dict, head: bool = False) -> None:
        name = getattr(func, "__name__", "")
        rows, length = given.shape[0], given.shape[1]
        if name == "__getitem__" and len(args) > 1:
            read = _indexed(args[1], rows, length)
        elif name == "gather":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            index = args[2] if len(args) > 2 else kwargs.get("index")
            read = _gathered(dim, index, rows, length)
        else:
            return
        if read is not None:  # (its pooling, read: followed no longer, so the mode is off again for the rest of the
            self._kept(record, read, head, id(given), rows, read[2] == CELL)  # program: the next model call, an embedder's loop, runs
            # untouched until its own output)

    def _kept(self, record: dict, read: tuple, head: bool, given: int, rows: int, cell: bool) -> None:
        """`read` (rows, positions, how) kept on `record`; the output `given` followed no longer once it is read (`cell`:
        a row at a time, once as many rows are read as it has; a row read twice is a loop over positions, no pooling)."""
        record["reads"].append({"rows": read[0], "positions": read[1], "head": head, "cell": cell,
                                "how": read[2] + (" of a head computed over it" if head else "")})
        cells = [r for r in record["reads"] if r["cell"]]
        if len(cells) > len({int(r["rows"][0]) for r in cells}):  # (what a loop over positions read, let go)
            record["reads"] = [r for r in record["reads"] if r not in cells]
            self._found.pop(given, None)
        elif not cell or len(record["reads"]) >= rows:
            self._found.pop(given, None)


def _mask(module, args: tuple, kwargs: dict):
    """The `attention_mask` a module call was handed; where it was handed none, its (B, L) ids against the pad id the
    model states (its token embedding's padding_idx, its config's pad_token_id: trace/tokenids.py), as the model's own
    mask would read them (RecBole's `item_seq != 0`, behind `nn.Embedding(padding_idx=0)`), where that id is no eos
    the program may pool at; else None."""
    mask = kwargs.get("attention_mask")
    if mask is None:
        from maskcli.trace.targetside import beside
        from maskcli.trace.tops import IDS, _given

        signature, given = _given(module, args, kwargs)
        mask = given.get("attention_mask")
        if mask is None and "attention_mask" not in given and signature is not None:
            name = next((n for n in IDS if n in given), next((n for n in signature.parameters if n != "self"), None))
            ids = given.get(name)
            if beside(signature.parameters, given, name) is not None:
                ids = None  # (a seq2seq's call handed target ids too (toynlp's `target_token_ids`): its output's
                # positions are theirs, not the source's)
            if type(ids) is torch.Tensor and ids.dim() == 2 and not ids.is_floating_point() and ids.dtype != torch.bool:
                from maskcli.trace.tokenids import token_ids

                stated = token_ids(module)
                pad = stated.get("pad_id")
                if pad is not None and pad != stated.get("eos_id"):
                    mask = ids != pad
                    mask.stated_by = f"its ids `{name}` padded with the pad id {pad} the model states"
    if isinstance(mask, dict) or type(mask) is torch.Tensor and mask.dim() == 4:
        return _rows_seeing(mask)
    if type(mask) is torch.Tensor and mask.dim() == 3 and mask.shape[1] == 1:
        return mask[:, 0]  # (a (B, 1, L) mask, each sample's (1, L) stacked: sunzeyeah/RLHF's reward collator)
    return mask


def _rows_seeing(mask):
    """A (B, H, Lq, Lk) mask the call was handed itself (or a mapping of them by layer type: Gemma 3's {full,
    sliding}) states its rows' tokens as the queries that see some key in it: (B, Lq), where some query sees none
    (OpenTau#524: a pad slot's query row, pad x pad, is all False). None where it is no such mask, or too large to read
    at every outermost call (a long sequence's)."""
    masks = [m for m in mask.values()] if isinstance(mask, dict) else [mask]
    if not masks or any(type(m) is not torch.Tensor or m.dim() != 4 or m.shape != masks[0].shape for m in masks):
        return None
    if masks[0].shape[0] * masks[0].shape[2] > MOST or masks[0].numel() > MOST * 256:
        return None
    seeing, keys = None, True
    for m in masks:
        kept = m if m.dtype == torch.bool else m > ADDED if m.is_floating_point() else m != 0  # (BERT's -10000 too)
        keys = keys and (kept.shape[2] == 1 or kept.shape[3] == kept.shape[2] and bool((kept == kept[:, :, :1]).all()))
        rows = kept.any(dim=3).any(dim=1)
        seeing = rows if seeing is None else seeing | rows
    if keys and len(masks) == 1:  # (every query row alike: a key padding mask expanded, (B, 1, L, L) or (B, 1, 1, L),
        seeing = kept[:, :, 0, :].any(dim=1)  # its rows' tokens are the keys it keeps: CLIP's text encoder's)
        seeing.stated_by = "the 4-D attention_mask it was called with (the keys it keeps, alike in every query row)"
        seeing.keys_kept = True
        seeing.said = "attention_mask"
        return seeing
    seeing.stated_by = "the 4-D attention_mask it was called with (where a query row sees no key)"
    seeing.said = "attention_mask"
    return seeing


def _layer(module, parent) -> bool:
    """`module` is one block of a ModuleList the module running around it holds (a model's layers)."""
    try:
        return any(type(child) is torch.nn.ModuleList and any(block is module for block in child)
                   for child in parent.children())
    except Exception:  # noqa: BLE001 - the program's modules
        return False


def _padded(mask) -> bool:
    """A (B, L) 0/1 or bool tensor with some 0 in it."""
    return type(mask) is torch.Tensor and mask.dim() == 2 and mask.numel() <= MOST and not mask.is_floating_point() \
        and mask.device.type != "meta" and not bool(mask.all())


def _hidden(output, kwargs: dict):
    """The (B, L, D) float `last_hidden_state` an output states, else its (B, L, V) `logits` where they are the
    call's own positions' (no encoder-decoder's, no call handed `labels` or `decoder_*` inputs), with its name; or
    (None, "")."""
    def stated(name: str):
        return output.get(name) if isinstance(output, dict) else getattr(output, name, None)

    if isinstance(output, tuple) and output and type(output[0]) is torch.Tensor and _stacked(output[0]) in (3, 4):
        output = output[0]  # (return_dict=False: a model's hidden states first, as a hand-written one returns them)
    if type(output) is torch.Tensor:  # (a hand-written model's forward returning its (B, L, D) output itself, or
        hidden, what = output, "output"  # (B, 1, L, D) where each sample's ids were (1, L), stacked)
        return (hidden, what) if _stacked(hidden) and hidden.is_floating_point() and hidden.device.type != "meta" \
            and kwargs.get("labels") is None else (None, "")
    what = "last_hidden_state"
    hidden = stated(what)
    if hidden is None and stated("encoder_last_hidden_state") is None and kwargs.get("labels") is None \
            and not any(name.startswith("decoder_") for name in kwargs):
        what, hidden = "logits", stated("logits")
    if type(hidden) is not torch.Tensor or hidden.dim() != 3 or not hidden.is_floating_point() or hidden.device.type == "meta":
        return None, ""
    return hidden, what


def _states(output, hidden) -> tuple:
    """(each of the output's `hidden_states` of its followed output's (B, L), with its name) where the call was asked for
    them, other than the followed output itself (a causal LM's logits: an RLHF reward head reads
    `output.hidden_states[-1]`; a control vector reads each layer's last token, repeng's `hidden_states[k]`), else ()."""
    states = output.get("hidden_states") if isinstance(output, dict) else getattr(output, "hidden_states", None)
    if not isinstance(states, (tuple, list)) or len(states) > MOST:
        return ()
    return tuple((state, f"hidden_states[{'-1' if at == len(states) - 1 else at}]") for at, state in enumerate(states)
                 if type(state) is torch.Tensor and state is not hidden and state.dim() == 3
                 and state.shape[:2] == hidden.shape[:2] and state.is_floating_point())
