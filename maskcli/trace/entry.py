"""The torch functions a trace looks at, patched where they are entered: the rest of torch runs untouched.

A TorchFunctionMode on for the whole run makes every torch call of the program pay a Python
dispatch (a tiny model's generate: 1.4x before anything is recorded). So, as profilers do,
the few entry points that matter are swapped while tracing, on torch's classes and modules:
attention (F.scaled_dot_product_attention, the softmaxes), the products that make q @ kᵀ
scores (scores.py), the casts and sums where a fill may overflow (overflow.py), and the out-of-place masked_fills
whose result may be thrown away (discarded.py). A builtin
is replaced by a wrapper in its namespace (torch.softmax, torch.Tensor.to, Tensor.__add__);
a Python function has its code swapped (patch.swap: F.softmax, torch.einsum), so that names
bound to it earlier reach the hook too. Each wrapper hands the call to Trace.dispatch as the
mode would see it (`a + b` as Tensor.add). The mode itself is entered only while a tensor it
follows is alive (scores, an overflowed fill, a softmax's weights: what is computed from
them is what it must see), and left at the next wrapper call once none is.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

import maskcli.trace.assigned as assigned
from maskcli.trace.after import MULS
from maskcli.trace.discarded import FILLS, wanted as _fill
from maskcli.trace.maskfacts import attention_bias
from maskcli.trace.maskmean import MEANS, REDUCES, over_positions, reduced
from maskcli.trace.overflow import CASTS, may_overflow
from maskcli.trace.sinusoid import candidate as stands_for_positions
from maskcli.trace.patch import swap
from maskcli.trace.permuted import GATHERS, noted
from maskcli.trace.poolweights import fills_or, weighs_or
from maskcli.trace.scores import MATMULS, per_graph
from maskcli.trace.unseen import plain, unseen

compiling = torch.compiler.is_dynamo_compiling

# attribute -> the function the mode is handed for it (a dunder is dispatched under its method's name)
TENSOR = {"softmax": "softmax", "matmul": "matmul", "__matmul__": "matmul", "bmm": "bmm", "baddbmm": "baddbmm",
          "to": "to", "half": "half", "bfloat16": "bfloat16", "type": "type", "type_as": "type_as",
          "add": "add", "__add__": "add", "__radd__": "add", "sub": "sub", "__sub__": "sub", "__rsub__": "__rsub__",
          "mul": "mul", "__mul__": "mul", "__rmul__": "mul", "mm": "mm", "masked_fill": "masked_fill", "sum": "sum",
          "mean": "mean", "gather": "gather"}
TORCH = ("softmax", "matmul", "bmm", "baddbmm", "add", "sub", "mul", "mm", "masked_fill", "sum", "mean", "gather")
CANONICAL: dict = {}  # a wrapper -> the function it stands for (what the mode is handed, while it is on, for a method)


@functools.cache
def _originals() -> dict:
    """Each patched attribute's function as torch defines it, read once before any trace patched them."""
    found = {("tensor", name): torch.Tensor.__dict__.get(name, getattr(torch.Tensor, name)) for name in TENSOR}
    found.update({("torch", name): getattr(torch, name) for name in TORCH})
    found[("special", "softmax")] = torch.special.softmax
    found[("F", "scaled_dot_product_attention")] = F.scaled_dot_product_attention
    return found


def canonical(func):
    return CANONICAL.get(func, func)


def sdpa():
    """F.scaled_dot_product_attention as torch defines it (while tracing F's attribute is a wrapper)."""
    return _originals()[("F", "scaled_dot_product_attention")]


ATTENTION, PRODUCT, CAST, SUM, FILL, REDUCE, MEAN, PERMUTE = ("attention", "product", "cast", "sum", "fill", "reduce",
                                                             "mean", "permute")


def _wrapper(trace, original, stands_for, kind: str):
    during, mode, local, after = trace.compiled.during, trace.mode_for_compile, trace._local, trace.after_call
    attention = stands_for is sdpa()
    wanted = _WANTED[kind]
    if kind == SUM and stands_for in MULS:  # (or a softmax's weights weighing values: trace/poolweights.py)
        wanted = weighs_or(trace, wanted)
    if kind == FILL:
        after, wanted = trace.after_fill, fills_or(trace, wanted)
    if kind == PERMUTE:  # (tokens reordered in each row: trace/permuted.py keeps the permutation, nothing follows)
        wanted = noted(trace)

    def wrapper(*args, **kwargs):
        if compiling():  # dynamo inlines this: nothing of the trace in its graph but a break at attention
            if attention:
                return during(mode, stands_for, (), args, kwargs)
            return original(*args, **kwargs)
        if attention and _stack_depth() and _program_mode(mode):  # (the program's mode decides what runs: handed F's
            return _to_program_mode(args, kwargs)  # attribute as python hands it, the attention it runs recorded)
        if local.busy or local.moded or not local.traced or not trace.active:  # (the rare cases: Trace.passes)
            if trace.passes():
                return original(*args, **kwargs)
            return trace.dispatch(stands_for, args, kwargs, original)
        if wanted is None:
            return trace.dispatch(stands_for, args, kwargs, original)
        out = original(*args, **kwargs)  # (what follows: nothing is followed in this thread, the mode is off)
        try:
            if plain(args, kwargs, out):
                if wanted(args, kwargs, out):
                    after(stands_for, args, kwargs, out)
            else:
                with unseen():  # (a subclass's __torch_function__ sees the program's calls only, as under python)
                    if wanted(args, kwargs, out):
                        after(stands_for, args, kwargs, out)
        except (Exception, SystemExit):  # noqa: BLE001 - nothing of the trace reaches the program (an odd result it cannot ask)
            pass
        return out

    wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = _named(stands_for)  # (not update_wrapper: every trace makes
    CANONICAL[wrapper] = stands_for  # these, and __wrapped__ would give inspect.signature a builtin's, which has none)
    return wrapper


def _product(args: tuple, kwargs: dict, out) -> bool:
    """A product that may be q @ kᵀ (scores.py reads its operands; a 2-D one of two tensors no parameter made)."""
    return isinstance(out, torch.Tensor) and (out.dim() >= 3 or out.dim() == 2 and per_graph(args))


def _cast(args: tuple, kwargs: dict, out) -> bool:
    """A cast that may overflow: to a floating dtype of a smaller range (overflow.py)."""
    given = args[0] if args else None
    return isinstance(out, torch.Tensor) and isinstance(given, torch.Tensor) and given.dtype != out.dtype \
        and out.is_floating_point() and given.is_floating_point() and _largest(out.dtype) < _largest(given.dtype)


def _sum(args: tuple, kwargs: dict, out) -> bool:
    """A sum or product that may have overflowed a fill (overflow.py's may_overflow). (Every sum a model runs passes
    here: its dtype is looked up in a set, which costs less than asking the tensor.)"""
    return isinstance(out, torch.Tensor) and out.dtype in _FLOATING and out.dim() >= 2 \
        and (may_overflow(args, kwargs, out) or stands_for_positions(args, out))  # (or adds a position encoding)


_FLOATING = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point)


_WANTED = {ATTENTION: None, PRODUCT: _product, CAST: _cast, SUM: _sum, FILL: _fill, REDUCE: reduced, MEAN: over_positions,
           PERMUTE: None}


@functools.lru_cache(maxsize=None)
def _largest(dtype) -> float:
    return torch.finfo(dtype).max


@functools.lru_cache(maxsize=None)
def _named(function) -> tuple:
    name = getattr(function, "__name__", "wrapper")
    return name, getattr(function, "__qualname__", name), getattr(function, "__doc__", None)


def patch(trace) -> list:
    """Swap the entry points of the functions `trace` watches (trace.watched: its readers', the matmuls that make
    scores, the casts and sums where a fill may overflow); the callables that put them back, in the order to run them."""
    originals = _originals()
    watched, readers = trace.watched, trace.readers
    done = []  # (owner, name, what it held, the wrapper put there)
    for owner, name, original, stands_for in _entries():
        if stands_for not in watched or owner is F and stands_for not in readers:
            continue
        held = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)
        kind = ATTENTION if stands_for in readers else PRODUCT if stands_for in MATMULS else CAST if stands_for in CASTS \
            else FILL if stands_for in FILLS else MEAN if stands_for in MEANS else REDUCE if stands_for in REDUCES \
            else PERMUTE if stands_for in GATHERS else SUM
        wrapper = _wrapper(trace, original, stands_for, kind)
        setattr(owner, name, wrapper)
        done.append((owner, name, held, wrapper))
    builtins = _jit_builtins(done)

    def put_back() -> None:  # (one callable for them all: a trace is entered once per generate, as often as it records)
        for key in builtins:
            _builtin_table().pop(key, None)
        for owner, name, held, wrapper in reversed(done):
            CANONICAL.pop(wrapper, None)
            if held is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, held)

    undo = [put_back, assigned.patch(trace)]  # (and each block's assigned shift_size: trace/assigned.py)
    python = {f for f in watched if isinstance(f, types.FunctionType)} - {F.multi_head_attention_forward, *originals.values()}
    for function in python:  # F.softmax, torch.einsum, the losses (losses.py): their code swapped (every name bound);
        # (MHA's functional form is swapped by modules.py, which reads the module around it)
        put_back_code = swap(function, lambda original, function=function: _hook(trace, original, function))
        if put_back_code is not None:
            undo.append(put_back_code)
    return undo[::-1]


def _builtin_table() -> dict:
    from torch.jit._builtins import _get_builtin_table

    return _get_builtin_table()


def _jit_builtins(done: list) -> list:
    """TorchScript's operator for each wrapper put on `torch` in place of one of its builtins (`torch.sum` in a
    `@torch.jit.script` function the program defines while traced: scripted, it must name aten::sum, not the wrapper,
    whose `*args` TorchScript cannot compile); the keys added, taken out again as the functions are put back."""
    try:
        table = _builtin_table()
    except (Exception, SystemExit):  # noqa: BLE001 - a torch without TorchScript: nothing to name
        return []
    added = []
    for owner, name, held, wrapper in done:
        op = table.get(id(held)) if owner is torch else None
        if op is not None and id(wrapper) not in table:
            table[id(wrapper)] = op
            added.append(id(wrapper))
    return added


@functools.cache
def _entries() -> tuple:
    """(owner, attribute, the function as torch defines it, the function it stands for) of each entry point patch() may
    wrap, in the order it wraps them."""
    originals = _originals()
    found = [(torch.Tensor, name, originals[("tensor", name)], originals[("tensor", method)]) for name, method in TENSOR.items()]
    found += [(torch, name, originals[("torch", name)], originals[("torch", name)]) for name in TORCH]
    found.append((torch.special, "softmax", originals[("special", "softmax")], originals[("special", "softmax")]))
    found.append((F, "scaled_dot_product_attention", _sdpa_as_called, sdpa()))
    return tuple(found)


def _sdpa_as_called(*args, **kwargs):
    """torch's SDPA as the program's call reaches it: an attention-bias object (CausalBias) runs its own `_dispatch` only
    where its __torch_function__ is handed F.scaled_dot_product_attention itself (it compares identity with F's
    attribute, which is the wrapper while tracing): it is handed its dispatch here, as python would hand it."""
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if attention_bias(mask):
        return type(mask)._dispatch(*args, **kwargs)
    return sdpa()(*args, **kwargs)


_stack_depth = torch._C._len_torch_function_stack


def _program_mode(ours) -> bool:
    """Whether the innermost TorchFunctionMode on this thread's stack is the program's, not a trace's (`ours`' type)."""
    return type(torch._C._get_function_stack_at(_stack_depth() - 1)) is not type(ours)


def _to_program_mode(args: tuple, kwargs: dict):
    """SDPA called under a TorchFunctionMode of the program's: its __torch_function__ is handed F's attribute, as
    python hands it (ParaAttention's SparseKVAttnMode runs its own attention where `func is
    F.scaled_dot_product_attention`; handed torch's builtin, as the wrapper's call would hand it, it ran plain SDPA
    instead). What the mode then calls, with itself off the stack, is recorded as any call is."""
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    return torch.overrides.handle_torch_function(F.scaled_dot_product_attention, tensors, *args, **kwargs)


def _hook(trace, original, stands_for):
    def hook(*args, **kwargs):
        if compiling() or trace.passes():
            return original(*args, **kwargs)
        return trace.dispatch(stands_for, args, kwargs, original)

    return hook


_MISSING = object()


def codes() -> tuple:
    """The code of the wrappers and hooks (dynamo must run them as Python, never compile them as frames of their own)."""
    return tuple(c for f in (_wrapper, _hook) for c in f.__code__.co_consts if isinstance(c, types.CodeType))
