"""nn.MultiheadAttention and nn.TransformerEncoder(Layer) run with the mode paused, each call recorded as the path it took.

These modules take a fused fast path (torch._native_multi_head_attention, nested tensors)
only where no argument "has a torch function", and an active TorchFunctionMode makes every
tensor have one: traced under the mode they would take the slow path and compute slightly
different numbers (and nested-tensor zeros at padding would differ). So while tracing, their
forward is wrapped at the class and the original forward runs with maskcli's mode popped off
the stack. The two paths apply different masks for the same arguments: the slow path hands
is_causal to F.multi_head_attention_forward, which drops attn_mask for SDPA's causal mask
where there is no key padding and no weights; the fast paths merge attn_mask and the key
padding and never read is_causal (with no attn_mask: no mask at all). So the call is read
after it ran, from what the path it took was given.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

from maskcli.trace.masks import mha as read_functional


@functools.cache
def forward_signature(cls) -> inspect.Signature:
    """`cls.forward`'s signature, read once a class."""
    return inspect.signature(cls.forward)


@functools.cache
def signature_or_none(cls) -> inspect.Signature | None:
    """forward_signature, or None where the class's forward has none to read (a builtin's, a C extension's)."""
    try:
        return forward_signature(cls)
    except (TypeError, ValueError):
        return None


def _arguments(module, args: tuple, kwargs: dict) -> dict:
    """The module's forward arguments by name, defaults filled in."""
    bound = forward_signature(type(module)).bind(module, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _as_functional(module: nn.MultiheadAttention, query, key, value, **masks) -> tuple[tuple, dict]:
    """The arguments F.multi_head_attention_forward gets from this module (its (L, N, E) layout), for the reader."""
    if module.batch_first and query.dim() == 3:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    kwargs = dict(query=query, key=key, value=value, embed_dim_to_check=module.embed_dim, num_heads=module.num_heads,
                  in_proj_weight=None, in_proj_bias=None, bias_k=module.bias_k, bias_v=module.bias_v,
                  add_zero_attn=module.add_zero_attn, dropout_p=module.dropout, out_proj_weight=None, out_proj_bias=None,
                  training=module.training, **masks)
    return (), kwargs


def read_fast_mha(args: tuple, kwargs: dict):
    """nn.MultiheadAttention's fast path (torch._native_multi_head_attention): attn_mask and key_padding_mask merged by
    merge_masks, is_causal never read (torch/nn/modules/activation.py, MultiheadAttention.forward, lines 1427-1447 of
    torch 2.13)."""
    module, *rest = args
    a = _arguments(module, rest, kwargs)
    seen = read_functional(*_as_functional(module, a["query"], a["key"], a["value"], key_padding_mask=a["key_padding_mask"],
                                           need_weights=a["need_weights"], attn_mask=a["attn_mask"], is_causal=False))
    return _fast(seen, a["is_causal"], a["attn_mask"])


def read_fast_encoder_layer(args: tuple, kwargs: dict):
    """nn.TransformerEncoderLayer's fast path (torch._transformer_encoder_layer_fwd): src against itself with src_mask
    and src_key_padding_mask merged by merge_masks, is_causal never read (torch/nn/modules/transformer.py,
    TransformerEncoderLayer.forward, lines 913-938 of torch 2.13)."""
    module, *rest = args
    a = _arguments(module, rest, kwargs)
    src, padding, mask, is_causal = a["src"], a["src_key_padding_mask"], a["src_mask"], a["is_causal"]
    nested = src.is_nested and _ENCODERS
    if nested:  # the encoder packed its padded input into a nested tensor: read its padding
        outer = _ENCODERS[-1]
        src, padding, mask = outer["src"], outer["src_key_padding_mask"], outer["mask"]
    seen = read_functional(*_as_functional(module.self_attn, src, src, src, key_padding_mask=padding,
                                           need_weights=False, attn_mask=mask, is_causal=False))
    seen.child = "self_attn"
    if nested:
        seen.details["nested"] = True  # (its padded tokens left out of the nested tensor: they come back 0)
    return _fast(seen, is_causal, mask)


def _fast(seen, is_causal, mask):
    """The fast path noted on the call, and is_causal=True that it ignored where it was given no mask."""
    seen.details["path"] = "fast"
    seen.details["is_causal"] = bool(is_causal)
    if is_causal:
        if mask is None:
            seen.details["ignored_is_causal"] = ("no mask was given, so no mask was applied: every query sees every key "
                                                 "(the slow path, in training or with grad, refuses is_causal without a mask)")
        # a mask given is applied as it is: checks/kernels.py's hint-ignored reads it for queries that see later keys
    return seen


read_fast_mha.api = read_fast_encoder_layer.api = "mha"
_ENCODERS: list[dict] = []  # the arguments of the nn.TransformerEncoder calls running, innermost last
_LOCAL = threading.local()  # per thread: the F.multi_head_attention_forward calls seen while an MHA forward runs
WRAPPED = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


@contextlib.contextmanager
def paused(mode):
    """`mode` off the torch function stack while the body runs, where it is the innermost mode."""
    if mode is not None and torch.overrides._get_current_function_mode() is mode:
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield


def wrap(trace, record: bool = True) -> list:
    """Wrap each class's forward for `trace` (recording their calls where `record`); what puts them back.

    Which path a module takes is seen, not guessed: its slow path calls F.multi_head_attention_forward (swapped here to
    note its arguments, read then exactly as given), its fast path does not; an encoder layer whose self_attn never ran
    took its fast path. Each is recorded as that path computes it."""
    from maskcli.trace.patch import swap

    def note_slow(original):
        def hook(*args, **kwargs):
            if torch.compiler.is_dynamo_compiling():  # (a graph break while tracing: compiled.py)
                return trace.compiled.during(trace.mode_for_compile, F.multi_head_attention_forward, (), args, kwargs)
            notes = getattr(_LOCAL, "notes", None)
            if notes is not None:
                notes.append((args, kwargs))
                _LOCAL.notes = None  # only the module's own call, not one its functional form makes inside
            elif record and not trace.passes():  # called on its own: read as it is called (capture.py's dispatch)
                return trace.dispatch(F.multi_head_attention_forward, args, kwargs, original)
            return original(*args, **kwargs)

        return hook

    def recording() -> bool:
        return record and not trace.busy and trace.within == 0 and not torch.compiler.is_dynamo_compiling()

    def forward_mha(module, args, kwargs, original):
        if not recording():
            with paused(trace.mode):
                return original(module, *args, **kwargs)
        _LOCAL.attention = getattr(_LOCAL, "attention", 0) + 1  # (an encoder layer's self_attn ran: its slow path)
        notes, saved = [], getattr(_LOCAL, "notes", None)
        _LOCAL.notes = notes
        trace.within += 1
        try:
            with paused(trace.mode):
                out = original(module, *args, **kwargs)
        finally:
            trace.within -= 1
            _LOCAL.notes = saved
        if notes:
            trace.capture(read_functional, *notes[0])
        else:
            trace.capture(read_fast_mha, (module, *args), kwargs)
        if trace.rowsout._armed is not None:  # (its output followed where its frames state a row mask: rowsout.py)
            trace.rowsout.begin(trace, out, False)
            if trace.rowsout._found:
                trace._follow()
        return out

    def forward_layer(module, args, kwargs, original):
        if not recording():
            with paused(trace.mode):
                return original(module, *args, **kwargs)
        before = getattr(_LOCAL, "attention", 0)
        with paused(trace.mode):
            out = original(module, *args, **kwargs)
        if getattr(_LOCAL, "attention", 0) == before:  # its self_attn never ran: the fused fast path did the layer
            trace.capture(read_fast_encoder_layer, (module, *args), kwargs)
        return out

    def forward_encoder(module, args, kwargs, original):
        _ENCODERS.append(_arguments(module, args, kwargs))  # its layers may get a nested tensor: keep what it was given
        try:
            with paused(trace.mode):
                return original(module, *args, **kwargs)
        finally:
            _ENCODERS.pop()

    undo = []
    for cls, run in zip(WRAPPED, (forward_mha, forward_layer, forward_encoder)):
        original = cls.__dict__["forward"]

        def forward(module, *args, _original=original, _run=run, **kwargs):
            return _run(module, args, kwargs, _original)

        functools.update_wrapper(forward, original)
        cls.forward = forward
        undo.append(lambda cls=cls, original=original: setattr(cls, "forward", original))
    swapped = swap(F.multi_head_attention_forward, note_slow)
    if swapped is not None:
        undo.append(swapped)
    return undo


def unwrap(undo: list) -> None:
    for put_back in reversed(undo):
        put_back()
