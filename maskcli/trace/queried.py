"""How many queries the attending layer was handed: the (batch, length) of its forward's first input.

Read only at a call whose frames hold a padding mask (trace/held.py): checks/crossq.py asks whether a
cross-attention's queries were cut by its keys' padding (a varlen kernel's `_upad_input`, written for
self-attention, unpads the image queries with the text key mask: vllm-omni#5865), which needs the queries the layer
was given, not the ones the kernel was handed.
"""

from __future__ import annotations

import itertools
import sys

import torch

from maskcli.trace.blockwindows import note as block_windows
import maskcli.trace.nowindow as nowindow
from maskcli.trace.builtflag import built_not_causal
from maskcli.trace.placedids import placed_ids
from maskcli.trace.querygroups import note as query_groups
from maskcli.trace.scores import HEADS, stated_heads

INNERMOST = 4  # running modules read, innermost first (a whole model's input speaks for no one layer)
FRAMES = 24


def query_input(stack: list) -> tuple[int, int] | None:
    """(B, L) of the first tensor argument, (B, L, D), of the forward of the innermost running module that owns
    weights (the layer that projects the queries, not a parameter-free kernel wrapper inside it); None where none."""
    first = first_input(stack)
    return None if first is None else (int(first.shape[0]), int(first.shape[1]))


def first_input(stack: list) -> torch.Tensor | None:
    """The first tensor argument, (B, L, D), of the forward of the innermost running module that owns weights."""
    owner = next((m for m in reversed(stack[-INNERMOST:]) if next(m.parameters(), None) is not None), None)
    return None if owner is None else first_inputs([owner]).get(id(owner))


def first_inputs(owners: list) -> dict:
    """{id(module): its forward's first tensor argument, (B, M, D), or None} for each of `owners` whose forward is on
    the stack."""
    found, frame, searched = {}, sys._getframe(2), 0
    while owners and frame is not None and searched < FRAMES:
        searched += 1
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount > 1:
            owner = frame.f_locals.get("self")
            if any(owner is m for m in owners) and id(owner) not in found:
                first = frame.f_locals.get(code.co_varnames[1])
                found[id(owner)] = first if issubclass(type(first), torch.Tensor) and first.dim() == 3 else None
        frame = frame.f_back
    return found


def layer_tensors(stack: list) -> list[torch.Tensor]:
    """The first tensor argument, (B, M, D), of each running module that owns weights, up to INNERMOST of them,
    innermost first, whose forward is on the stack: the tokens each layer and the block around it were handed (a block
    that joins the image and text tokens before its nn.MultiheadAttention: checks/jointpad.py)."""
    owners = [m for m in reversed(stack[-INNERMOST:]) if next(m.parameters(), None) is not None]
    found = first_inputs(owners)
    return [found[id(m)] for m in owners if found.get(id(m)) is not None]


def folded_inputs(stack: list, shape: tuple) -> tuple[tuple[int, int], tuple[str, int, int]] | None:
    """((B, N), (name, B, M)) where a one-row call over Lq = B * N queries and Lk = B * M keys (B >= 2) is made inside
    the forward of the innermost running module that owns weights, whose first argument is (B, N, D) and whose other
    tensor argument `name` is (B, M, D'): the layer was handed B samples and B memories and folded both into one
    sequence (Open-Sora#609's MultiHeadCrossAttention(x, cond, mask=None): checks/foldedcross.py); None otherwise."""
    q_len, k_len = int(shape[2]), int(shape[3])
    owner = next((m for m in reversed(stack[-INNERMOST:]) if next(m.parameters(), None) is not None), None)
    frame, searched = sys._getframe(2), 0
    while owner is not None and frame is not None and searched < FRAMES:
        searched += 1
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount > 2 and frame.f_locals.get("self") is owner:
            values = [(name, frame.f_locals.get(name)) for name in code.co_varnames[1:code.co_argcount]]
            first = values[0][1]
            if not issubclass(type(first), torch.Tensor) or first.dim() != 3 or first.shape[0] < 2 \
                    or int(first.shape[0]) * int(first.shape[1]) != q_len:
                return None
            batch = int(first.shape[0])
            for name, value in values[1:]:
                if issubclass(type(value), torch.Tensor) and value.dim() == 3 and int(value.shape[0]) == batch \
                        and batch * int(value.shape[1]) == k_len:
                    return (batch, int(first.shape[1])), (name, batch, int(value.shape[1]))
            return None
        frame = frame.f_back
    return None


def note(details: dict, stack: list, api: str = "", shape: tuple | None = None, walked=None) -> None:
    """details["query_input"] = query_input(stack), at a call whose frames hold padding (details["held_padding"]); at a
    softmax, details["stated_heads"]: the head count its innermost module that states one holds, which tells which axis
    of hand-written scores is heads (checks/heads.py). At a one-row call over several queries that another
    sequence's keys (details["cross"]), the layer's folded samples and memories: details["query_input"] and
    details["memory_input"] (folded_inputs). At every call, the windows the running modules state where two differ
    (trace/blockwindows.py: details["block_windows"]), the query groups a running module states (trace/querygroups.py:
    details["query_groups"]); under a model the script built not causal, details["built_not_causal"]
    (trace/builtflag.py)."""
    if api == "softmax" and (heads := stated_heads(stack, HEADS + ("heads", "n_local_heads"))) is not None:
        details["stated_heads"] = heads
        if shape is not None and heads > 1 and int(shape[0]) % heads == 0 and int(shape[1]) > 1 and stack:
            heads_folded(details, stack, shape, heads)
    own_heads(details, stack, api)  # (q or k laid (B, L, H, D): the head count its module states, trace/regrouped.py)
    if "held_padding" in details and stack:
        given = query_input(stack)
        if given is not None:
            details["query_input"] = given
        tensors = layer_tensors(stack)
        layers = [(int(t.shape[0]), int(t.shape[1])) for t in tensors]
        if layers and layers != [given]:
            details["layer_inputs"] = layers
        placed = placed_ids(tensors[0]) if tensors else None
        if placed is not None:
            details["placed_ids"] = placed
    if shape is not None and stack and int(shape[0]) == 1 and int(shape[2]) > 2 and details.get("cross") \
            and "query_input" not in details:
        folded = folded_inputs(stack, shape)
        if folded is not None:
            details["query_input"], details["memory_input"] = folded
    block_windows(details, stack)
    nowindow.note(details, stack, shape, walked)  # (a None window beside the map it was handed: checks/nowindow.py)
    query_groups(details, stack)  # (the query groups a module states it trains with: checks/querygroups.py)
    if "module_causal" in details and (built := built_not_causal(stack)) is not None:
        details["built_not_causal"] = built  # (the model built causal=False around it: checks/builtcausal.py)


def heads_folded(details: dict, stack: list, shape: tuple, heads: int) -> None:
    """details["heads_folded"] = (B, L): the layer's input (B, L, D) where the scores' first axis is B * heads, the
    heads folded with the batch and the second axis something else (a blocked local attention's windows:
    checks/biaswindows.py)."""
    given = query_input(stack)
    if given is not None and given[0] * heads == int(shape[0]):
        details["heads_folded"] = list(given)


# details that name this process's objects (a query tensor's serial, a count of a function's runs: windows.py): read by
# the checks as the run ends, kept out of --json and --save (meaningless in a file, or beside another process's run)
LOCAL = ("query_tensor", "window_frame")

_COUNT = itertools.count()
_BASES = None  # the query tensors' bases seen alive, each with its serial number (a WeakIdKeyDictionary, made once)


def query_tensor(q: torch.Tensor) -> tuple | None:
    """Which queries a kernel was handed: (serial of q's base tensor, storage offset, shape, strides, the base's
    version). Two calls with equal ones attend the same query values (the base alive between them, so never memory
    reused, and not written in place since), as a cascade's prefix and new-token parts do (checks/prefill.py: no later
    chunk of a prompt); a prompt's next chunk has other queries. None where q is no plain tensor."""
    global _BASES
    try:
        base = q if q._base is None else q._base
        if _BASES is None:
            from torch.utils.weak import WeakIdKeyDictionary

            _BASES = WeakIdKeyDictionary()
        serial = _BASES.get(base)
        if serial is None:
            serial = _BASES[base] = next(_COUNT)
        return serial, q.storage_offset(), tuple(q.shape), tuple(q.stride()), base._version
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # (tensor subclasses: nothing to compare)
        return None


def own_heads(details: dict, stack: list, api: str) -> None:
    """The head count the innermost running module (the attention's own, not an enclosing model's) states, where q or
    k was laid (B, L, H, D) (details["heads_swapped"]["stated"]), or at a softmax, whose q @ kᵀ is read after it
    (details["own_heads"], where it states one: a few getattr on one module)."""
    if "heads_swapped" in details or api == "softmax":
        heads = stated_heads(list(stack)[-1:], HEADS + ("heads", "n_local_heads"))
        if "heads_swapped" in details:
            details["heads_swapped"]["stated"] = heads
        elif heads is not None:
            details["own_heads"] = heads
