"""A softmax's weights followed to the values: what the program computes of them after the softmax.

Each recorded softmax's output is followed (by identity, a weak reference: nothing is kept alive), and so is every
tensor computed from it alone that keeps its cells (a scaling, a dropout, a 0/1 product, a reshape of the same cells),
with the softmax it came from (its origin). Three things are read off them:

- an exp of weights is no softmax written by hand (trace/masks.py's exp_reader asks `has`): AKT's distance decay
  `exp(dist_scores * gamma)`, computed from the cumulative sum of a softmax's weights, is a decay, not attention;
- a recorded softmax over weights (DisKT#2: `F.softmax(p_attn)` over the probabilities) re-weights every key the
  first softmax masked (its weight 0 becomes exp(0), as heavy as any other): the call records `over_weights`, the
  first softmax's index (checks/weighted.py);
- a tensor added to the weights (`attn + Lg * adjacency_mat`: molecule-attention-transformer 23c9cbe) reaches the
  product with the values: where it gives a key the softmax masked weight (at least SHARE of its row's largest, on a
  row the softmax leaves some key), the origin records `weighted_after` (the first cell, how many, and whether the
  key is padding or later: checks/weighted.py).

A tensor computed from weights and from scores that are not weights (AKT's `scores * total_effect`) is scores, not
weights: only what is made of weights alone is followed.
"""

from __future__ import annotations

import torch

from maskcli.trace.after import PRODUCTS
from maskcli.trace.evaldrop import DROPOUTS, dropped
from maskcli.trace.followed import follow, operands_of
from maskcli.trace.handkv import values
from maskcli.trace.scores import ADDS

SHARE = 1e-3  # a masked key's weight counts from this share of its row's largest weight (an epsilon added does not)
MOST = 1 << 22  # cells compared at a product at most
CATS = frozenset({torch.cat, torch.concat, torch.concatenate})


def _rows(start: int, stop: int, seen) -> tuple | None:
    """The query rows (start, stop) of a softmax's weights, None where they are all of them."""
    whole = seen.keep is not None and start == 0 and stop == int(seen.keep.shape[-2])
    return None if whole else (start, stop)


class Weights:
    """The softmax outputs, and what is computed of them alone, by identity: id -> (ref, origin call, seen, added)."""

    def __init__(self):
        self._found: dict[int, tuple] = {}
        self._keyed: dict[int, tuple] = {}  # id(call) -> (call, its q @ kᵀ's operands' weak references: trace/handkv.py)

    def keyed(self, refs: tuple | None, call) -> None:
        """Keep `refs` (trace/handkv.keyed's) for the product of `call`'s weights with V."""
        if refs is not None:
            if len(self._keyed) >= 256:
                self._keyed.clear()
            self._keyed[id(call)] = (call, refs)

    def has(self, x) -> bool:
        return self.entry(x) is not None

    def entry(self, x) -> tuple | None:
        if not self._found or not isinstance(x, torch.Tensor):
            return None
        entry = self._found.get(id(x))
        return entry if entry is not None and entry[0]() is x else None

    def note(self, out, call, seen, given) -> None:
        """At softmax `call` (read as `seen`) over `given`, whose output is `out`: follow `out`; where `given` is weights
        of an earlier softmax, the call records it (`over_weights`) and `out` keeps that one as its origin."""
        try:
            prior = self.entry(given)
            if prior is not None:
                call.details["over_weights"] = seen.details["over_weights"] = prior[1].index
                if prior[4] is not None:  # (some of its query rows only: sparseKT's rows past k_index)
                    call.details["over_rows"] = seen.details["over_rows"] = list(prior[4])
                self._keep(out, prior[1], prior[2], False, prior[4])
            elif seen.keep is not None and "axes" not in seen.details:
                self._keep(out, call, seen, False)
        except Exception:  # noqa: BLE001 - nothing of the trace may reach the program: weights not followed
            pass

    def after(self, func, args: tuple, kwargs: dict, out, scores) -> None:
        """What a call computed of followed weights: followed in turn, or (a product) read against the softmax's mask."""
        if not self._found or not isinstance(out, torch.Tensor):
            return
        try:
            if func in DROPOUTS and args and (entry := self.entry(args[0])) is not None:
                dropped(func, args, kwargs, entry[1])  # (weights dropped in eval mode: trace/evaldrop.py)
            if func in PRODUCTS:
                self._values(func, args)
                self._product(func, args)
            elif func in CATS and args and isinstance(args[0], (list, tuple)):
                self._joined(args, kwargs, out)
            elif func is torch.Tensor.__getitem__ and out.dim() >= 2 and self._sliced(args, out):
                return
            elif out.dim() >= 2 and out.is_floating_point():
                self._carry(func, args, kwargs, out, scores)
        except Exception:  # noqa: BLE001 - nothing of the trace may reach the program
            pass

    def _carry(self, func, args: tuple, kwargs: dict, out, scores) -> None:
        entry, given, other = None, None, False
        for x in (*args, *kwargs.values()):
            if not isinstance(x, torch.Tensor):
                continue
            found = self.entry(x)
            if found is not None:
                entry, given = entry or found, given if given is not None else x
            elif scores is not None and scores.has(x):
                return  # (weights and logits together: AKT's scores * total_effect is scores)
            elif x.numel() > 1 and x.is_floating_point():
                other = True
        if entry is None or out.shape[-1] != given.shape[-1] or (
                tuple(out.shape[-2:]) != tuple(given.shape[-2:]) and out.numel() != given.numel()):
            return
        self._keep(out, entry[1], entry[2], entry[3] or (func in ADDS and other), entry[4])

    def _sliced(self, args: tuple, out) -> bool:
        """weights[..., a:b, :]: the query rows a to b of the weights (of the rows they held), followed with them.
        Whether it was such a slice of fewer rows (else _carry reads it as any other call)."""
        entry = self.entry(args[0]) if len(args) == 2 else None
        if entry is None:
            return False
        given, index = args[0], args[1] if isinstance(args[1], tuple) else (args[1],)
        if out.dim() != given.dim() or out.shape[-1] != given.shape[-1] or out.shape[:-2] != given.shape[:-2] \
                or out.shape[-2] == given.shape[-2]:
            return False
        axis = given.dim() - 2  # (the query axis: each index before it a whole slice, the one on it a step-1 slice)
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (given.dim() - len(index) + 1) + index[at + 1:]
        if len(index) <= axis or not all(isinstance(i, slice) and i == slice(None) for i in index[:axis]) \
                or any(not (isinstance(i, slice) and i == slice(None)) for i in index[axis + 1:]) \
                or not isinstance(index[axis], slice) or index[axis].step not in (None, 1):
            return False
        rows = entry[4] or (0, int(given.shape[-2]))
        start, stop, _ = index[axis].indices(rows[1] - rows[0])
        if stop - start != int(out.shape[-2]):
            return False
        self._keep(out, entry[1], entry[2], entry[3], _rows(rows[0] + start, rows[0] + stop, entry[2]))
        return True

    def _joined(self, args: tuple, kwargs: dict, out) -> None:
        """torch.cat of weights pieces of one softmax along their query rows, in order: the rows they hold together."""
        pieces = [self.entry(x) for x in args[0]]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not pieces or any(entry is None or entry[1] is not pieces[0][1] for entry in pieces) \
                or not isinstance(dim, int) or dim not in (-2, out.dim() - 2):
            return
        seen = pieces[0][2]
        spans = [entry[4] or (0, int(x.shape[-2])) for entry, x in zip(pieces, args[0])]
        if any(spans[i][1] != spans[i + 1][0] for i in range(len(spans) - 1)) \
                or spans[-1][1] - spans[0][0] != int(out.shape[-2]):
            return
        self._keep(out, pieces[0][1], seen, any(entry[3] for entry in pieces), _rows(spans[0][0], spans[-1][1], seen))

    def _keep(self, out, call, seen, added: bool, rows=None) -> None:
        follow(self._found, id(out), out, call, seen, added, rows)

    def _values(self, func, args: tuple) -> None:
        """weights @ V of a softmax whose q and kᵀ were kept: zero keys read in K and V (trace/handkv.py)."""
        operands = operands_of(func, args) if self._keyed and func is not torch.einsum else ()  # (V laid as matmul lays it)
        entry = self.entry(operands[0]) if len(operands) == 2 else None
        held = None if entry is None else self._keyed.pop(id(entry[1]), None)
        if held is not None and held[0] is entry[1]:
            values(entry[1], held[1], operands[1], entry[2].keep)

    def _product(self, func, args: tuple) -> None:
        operands = operands_of(func, args)
        entry = self.entry(operands[0]) if operands else None
        if entry is None or not entry[3] or "weighted_after" in entry[1].details:
            return  # (only weights something was added to: what else is computed of them keeps a masked key at 0)
        weights, (_, call, seen, _, _) = operands[0], entry
        keep = seen.keep
        if keep is None or weights.numel() != keep.numel() or weights.numel() > MOST:
            return
        with torch.no_grad():
            weight = weights.detach().reshape(keep.shape).abs()
            rows = keep.any(dim=-1, keepdim=True)
            bad = ~keep & rows & (weight > 0) & (weight >= SHARE * weight.amax(dim=-1, keepdim=True))
            if not bool(bad.any()):
                return
            b, h, q, k = (int(x) for x in bad.nonzero()[0])
            padding = bool((~keep[b, h] | ~rows[b, h]).all(dim=0)[k])  # (a key no query of the row sees)
            q_len, k_len = keep.shape[-2:]
            later = k - (k_len - q_len) > q and bool((~keep[b, h, q, k:]).all())
            found = {"cell": [b, h, q, k], "cells": int(bad.sum()), "padding": padding, "later": later,
                     "rows": int(bad.any(dim=-1).sum())}
        call.details["weighted_after"] = seen.details["weighted_after"] = found
