"""nn.MultiheadAttention and nn.TransformerEncoder(Layer) recorded from their own arguments, run with the mode paused.

These modules take a fused fast path (torch._native_multi_head_attention, nested tensors)
only where no argument "has a torch function", and an active TorchFunctionMode makes every
tensor have one: traced under the mode they would take the slow path and compute slightly
different numbers (and nested-tensor zeros at padding would differ). So while tracing, their
forward is wrapped at the class: the call is recorded from its arguments, merged as MHA
merges them, and the original forward runs with maskcli's mode popped off the stack.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn as nn

from maskcli.trace.masks import mha as read_functional


@functools.cache
def _signature(cls) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _as_functional(module: nn.MultiheadAttention, query, key, value, **masks) -> tuple[tuple, dict]:
    """The arguments F.multi_head_attention_forward gets from this module (its (L, N, E) layout), for the reader."""
    if module.batch_first and query.dim() == 3:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    kwargs = dict(query=query, key=key, value=value, embed_dim_to_check=module.embed_dim, num_heads=module.num_heads,
                  in_proj_weight=None, in_proj_bias=None, bias_k=module.bias_k, bias_v=module.bias_v,
                  add_zero_attn=module.add_zero_attn, dropout_p=module.dropout, out_proj_weight=None, out_proj_bias=None,
                  training=module.training, **masks)
    return (), kwargs


def read_mha(args: tuple, kwargs: dict):
    module, *rest = args
    bound = _signature(type(module)).bind(module, *rest, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return read_functional(*_as_functional(module, a["query"], a["key"], a["value"], key_padding_mask=a["key_padding_mask"],
                                           need_weights=a["need_weights"], attn_mask=a["attn_mask"], is_causal=a["is_causal"]))


def read_encoder_layer(args: tuple, kwargs: dict):
    """The layer's self-attention: src against itself with src_mask and src_key_padding_mask, no weights."""
    module, *rest = args
    bound = _signature(type(module)).bind(module, *rest, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    src, padding, mask, is_causal = a["src"], a["src_key_padding_mask"], a["src_mask"], a["is_causal"]
    if src.is_nested and _ENCODERS:  # the encoder packed its padded input into a nested tensor: read its padding
        outer = _ENCODERS[-1]
        src, padding, mask, is_causal = outer["src"], outer["src_key_padding_mask"], outer["mask"], outer["is_causal"]
    seen = read_functional(*_as_functional(module.self_attn, src, src, src, key_padding_mask=padding,
                                           need_weights=False, attn_mask=mask, is_causal=bool(is_causal)))
    seen.child = "self_attn"
    return seen


read_mha.api = read_encoder_layer.api = "mha"
_ENCODERS: list[dict] = []  # the arguments of the nn.TransformerEncoder calls running, innermost last
WRAPPED = ((nn.MultiheadAttention, read_mha), (nn.TransformerEncoderLayer, read_encoder_layer), (nn.TransformerEncoder, None))


@contextlib.contextmanager
def paused(mode):
    """`mode` off the torch function stack while the body runs, where it is the innermost mode."""
    if torch.overrides._get_current_function_mode() is mode:
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield


def wrap(trace, record: bool = True) -> list:
    """Wrap each class's forward for `trace` (recording their calls where `record`); the (class, original forward)
    pairs to put back."""

    def run(module, args, kwargs, original, reader):
        if reader is not None and not trace.busy and trace.within == 0 and not torch.compiler.is_dynamo_compiling():
            trace.capture(reader, (module, *args), kwargs)
        trace.within += reader is not None  # the MHA inside an encoder layer is the layer's call, not another
        try:
            with paused(trace.mode):
                return original(module, *args, **kwargs)
        finally:
            trace.within -= reader is not None

    undo = []
    for cls, reader in WRAPPED:
        reader = reader if record else None
        original = cls.__dict__["forward"]

        def forward(module, *args, _original=original, _reader=reader, **kwargs):
            if isinstance(module, nn.TransformerEncoder):  # its layers may get a nested tensor: keep what it was given
                bound = _signature(type(module)).bind(module, *args, **kwargs)
                bound.apply_defaults()
                _ENCODERS.append(bound.arguments)
            try:
                return run(module, args, kwargs, _original, _reader)
            finally:
                if isinstance(module, nn.TransformerEncoder):
                    _ENCODERS.pop()

        functools.update_wrapper(forward, original)
        cls.forward = forward
        undo.append((cls, original))
    return undo


def unwrap(undo: list) -> None:
    for cls, original in undo:
        cls.forward = original
