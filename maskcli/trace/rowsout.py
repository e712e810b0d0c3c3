"""Query rows a program states masked out, and whether their attention output is zeroed before it reaches a residual.

Mllama's cross-attention (and Meta's reference it follows) gives the text rows before the image no key: their bias
row is all the dtype's min, so `_prepare_cross_attention_mask` computes `full_text_row_masked_out_mask` ((B, 1, Lq, 1),
0 on those rows) and multiplies the bias by it, so that the softmax gives them uniform weights (no NaN), not none. The
program states there that those rows' output is to be discarded: the row mask must zero the attention's output before
it is added to the residual stream, or the rows read the image after all (transformers#39379: applied only to the MLP
branch).

Read at each attention call (a parameter of the program's frames under a name with "row" in it, ending in `mask`: a
(B, Lq), (B, Lq, 1) or (B, 1, Lq, 1) tensor of 0/1 or bools, some row 0), then, only where one is found, the call's
output is followed by identity until the next call is recorded: through every torch call of it (its transposes,
projections, the gate that scales it), stopping where a 0/1 product, a masked_fill of 0 or a `where` zeroes those
rows (the row mask's rows: compared as (B, Lq)). An addition of a followed tensor and a tensor it does not hold, of its
own shape (a residual), is where the rows' output reaches the stream: counted as `reached`, and `open` while that sum
itself is not zeroed afterwards. A product with the row mask of a tensor computed from the followed one (the MLP
branch of the sum) is `elsewhere`: the program zeroes those rows there. Details `row_mask` (checks/rowsout.py).
"""

from __future__ import annotations

import os
import re
import weakref

import torch

from maskcli.trace.codes import ByCode, named_parameters
from maskcli.trace.followed import KEEP

NAMED = re.compile(r"row\w*mask$")
MOST = 1 << 16  # cells of a row mask read at most
ADDS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
                  torch.Tensor.__iadd__})
MULS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.mul_, torch.Tensor.__mul__, torch.Tensor.__rmul__,
                  torch.Tensor.__imul__})
FILLS = frozenset({torch.masked_fill, torch.Tensor.masked_fill, torch.Tensor.masked_fill_})
WHERES = frozenset({torch.where})
PRODUCTS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
                      torch.einsum})

_NAMES = ByCode()


def _rows(value, q_len: int):
    """Bool (B, Lq) of a row mask (True: the row kept), or None where it is no such tensor or keeps every row."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.numel() > MOST or value.device.type == "meta":
        return None
    shape = [n for n in value.shape]
    if shape[-1] == 1:
        shape = shape[:-1]
    while len(shape) > 2 and shape[1] == 1:
        shape.pop(1)
    if len(shape) != 2 or shape[1] != q_len:
        return None
    cells = value.detach().reshape(shape).cpu()
    if not bool(((cells == 0) | (cells == 1)).all()) or bool((cells != 0).all()) or not bool((cells != 0).any()):
        return None
    return cells != 0


class RowsOut:
    """The followed outputs of the last call whose frames state a row mask (module docstring)."""

    def __init__(self):
        self._found: dict = {}  # id(tensor) -> (weakref, kind): "weights", "output", "sum"
        self._armed = None  # (rows, found dict) of the call just read, not yet run
        self._call = None  # (the call, its details["row_mask"]) being followed

    def note(self, details: dict, walked) -> None:
        """At each recorded call (capture.py's readers of the frames): what was followed ends; a row mask its frames
        hold is kept in details["row_mask"] and the call's output followed once it has run (begin)."""
        self._found.clear()
        self._armed, self._call = None, None
        if walked is None:
            return
        for _, code, name, value in named_parameters(walked, _NAMES, NAMED):
            rows = _rows(value, int(value.shape[-2] if value.shape[-1] == 1 else value.shape[-1])) \
                if isinstance(value, torch.Tensor) and value.dim() >= 2 else None
            if rows is None:
                continue
            found = {"name": name, "where": f"{code.co_name}() of {os.path.basename(code.co_filename)}",
                     "rows": rows.numpy().tolist(), "reached": 0, "open": 0, "elsewhere": 0, "zeroed": 0}
            details["row_mask"] = found
            self._armed = (rows, found)
            return

    def begin(self, trace, out, weights: bool) -> None:
        """After the call `note` armed for ran: its weights (a softmax) or its output (a kernel) followed."""
        armed, self._armed = self._armed, None
        if armed is None or not trace._calls or trace._calls[-1].details.get("row_mask") is not armed[1]:
            return
        call = trace._calls[-1]
        if armed[0].shape[1] != call.shape[2] or armed[0].shape[0] not in (1, call.shape[0]):
            call.details.pop("row_mask", None)  # (rows of another length: no row mask of this call's queries)
            return
        self._call = (armed[0], armed[1])
        if isinstance(out, tuple):
            out = out[0] if out else None
        if isinstance(out, torch.Tensor):
            self._keep(out, "weights" if weights else "output")

    def _keep(self, tensor: torch.Tensor, kind: str) -> None:
        found = self._found
        if len(found) >= KEEP:
            found.clear()  # (too much computed of it to follow: nothing said)
            self._call = None
            return
        key = id(tensor)

        def gone(ref) -> None:
            if found.get(key, (None,))[0] is ref:
                del found[key]

        try:
            found[key] = (weakref.ref(tensor, gone), kind)
        except TypeError:
            pass

    def _kind(self, value):
        held = self._found.get(id(value)) if isinstance(value, torch.Tensor) else None
        return held[1] if held is not None and held[0]() is value else None

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        """A torch call while outputs are followed (follow.py's _after_call): the rows zeroed, reaching a sum, or
        carried on to what the call made."""
        if self._call is None or not self._found:
            return
        rows, said = self._call
        operands = [a for a in args if isinstance(a, torch.Tensor)]
        for value in args:
            if isinstance(value, (list, tuple)):
                operands += [a for a in value if isinstance(a, torch.Tensor)]
        kinds = [self._kind(a) for a in operands]
        if not any(kinds):
            return
        if func in PRODUCTS and any(k == "weights" for k in kinds[:1]):
            if isinstance(out, torch.Tensor):
                self._keep(out, "output")
            return
        if all(k == "weights" or k is None for k in kinds):
            held = operands[kinds.index("weights")]
            if isinstance(out, torch.Tensor) and out.shape == held.shape and out is not held:
                self._keep(out, "weights")  # (the weights cast or dropped out: still the weights the values read)
            return
        if func in MULS and len(operands) == 2:
            mine, other = (operands[0], operands[1]) if kinds[0] else (operands[1], operands[0])
            if _zeroes(other == 0, rows, mine):
                self._zeroed(said, self._kind(mine), mine, out)
                return
        if func in FILLS and len(args) >= 3 and kinds[0] and isinstance(args[1], torch.Tensor) \
                and _number(args[2]) == 0 and _zeroes(args[1].to(torch.bool), rows, args[0]):
            self._zeroed(said, kinds[0], args[0], out)
            return
        if func in WHERES and len(args) == 3 and isinstance(args[0], torch.Tensor) and _number(args[2]) == 0 \
                and self._kind(args[1]) and _zeroes(~args[0].to(torch.bool), rows, args[1]):
            self._zeroed(said, self._kind(args[1]), args[1], out)
            return
        if func in ADDS and len(operands) == 2 and operands[0].shape == operands[1].shape \
                and sum(1 for k in kinds if k) == 1 and isinstance(out, torch.Tensor):
            said["reached"] += 1
            said["open"] += 1
            self._keep(out, "sum")
            return
        for made in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(made, torch.Tensor) and made.is_floating_point():
                self._keep(made, "output")

    def _zeroed(self, said: dict, kind, mine: torch.Tensor, out) -> None:
        """The rows of `mine` zeroed: a sum that reached the stream closed, a branch computed of it `elsewhere`, or
        the output itself before any sum."""
        if kind == "sum":
            said["open"] = max(0, said["open"] - 1)
        elif said["reached"]:
            said["elsewhere"] += 1
        else:
            said["zeroed"] += 1
        self._found.pop(id(mine), None)
        if isinstance(out, torch.Tensor) and out is mine:
            return  # (in place: nothing of it followed any more)


def _zeroes(zero, rows: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether `zero` (bool, broadcast to `target`) is True over every cell of the rows `rows` drops, read as (B, Lq)
    on the target's axes of those sizes (its batch axis first, the first later axis of Lq cells)."""
    if not isinstance(zero, torch.Tensor) or not bool(zero.any()):
        return False
    try:
        zero = zero.broadcast_to(target.shape)
    except RuntimeError:
        return False
    batch, q_len = rows.shape
    if target.dim() < 2 or target.shape[0] != batch:
        return False
    axis = next((i for i in range(1, target.dim()) if target.shape[i] == q_len), None)
    if axis is None:
        return False
    flat = zero.movedim(axis, 1).reshape(batch, q_len, -1).all(dim=-1).cpu()
    return bool(flat[~rows].all())


def _number(value):
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
