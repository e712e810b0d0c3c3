"""The padding the program's own frames hold at an attention call: a padding mask or the lengths of its batch.

Read at each call from the functions of the program on the stack (not torch's, maskcli's, nor the standard library's),
by variable name only (a code object's names are matched once; its locals are read only where one matches): a 2-D
mask of 0/1 or bools named as a padding mask is (or the diagonal of a (B, L, L) one named as padding: each token's own
cell), and 1-D integer lengths. checks/held.py says where the kernel's mask
lets real queries see what the program itself calls padding (a mask built, then never handed on: uniem#23).
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig

import numpy as np
import torch

KEEP = re.compile(r"(?:^|_)attention_mask$|^mask$|^input_mask$")  # 1 = a real token
PAD = re.compile(r"(?:^|_)(?:key_)?padding_mask$|(?:^|_)pad_mask$|(?:^|_)is_pad$")  # True = padding
LENGTHS = re.compile(r"^(?!cu_|max_)(?:\w+_)?(?:len|lens|lengths|seq_lens|seqlens)$")
CELLS = re.compile(r"(?:^|_)chunk_masks?$")  # a streaming encoder's chunk mask (L, L) or (B, L, L): its polarity unsaid
POSITIONS = re.compile(r"^(?:position_ids|positions|pos_ids)$")  # (B, L) positions that restart: packed documents
HANDED = re.compile(r"^(?:attention_mask|attn_mask|mask)$")  # a bool mask over the cells, handed down: polarity unsaid
MOST = 1 << 16  # cells of one held mask read at most (a batch's padding, not a sequence's cells)
FRAMES = 24

_NAMES: dict = {}  # code object -> the names of its variables that may hold padding (matched once per code), or
_OUTSIDE = object()  # for the code of torch, maskcli, the standard library: not the program's
_READ: dict = {}  # (id(tensor), name, code) -> (tensor, version, what it was read as): read once while unchanged


def _skipped() -> tuple[str, ...]:
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tuple({os.path.dirname(torch.__file__), own, *(sysconfig.get_paths()[k] for k in ("stdlib",))})


_SKIP: tuple = ()


def program_frames(frame, limit: int):
    """The program's own frames from `frame` outwards (torch's, maskcli's, the standard library's and `<...>` code left
    out), at most `limit` of them."""
    global _SKIP
    if not _SKIP:
        _SKIP = _skipped()
    searched = 0
    while frame is not None and searched < limit:
        name = frame.f_code.co_filename
        if not (name.startswith(_SKIP) or name.startswith("<")):
            searched += 1
            yield frame
        frame = frame.f_back


def padding() -> list[dict] | None:
    """[{name, where, kind: keep | pad | lengths, rows: np.ndarray}] held by the program's frames now; None if none."""
    global _SKIP
    if not _SKIP:
        _SKIP = _skipped()
    frame, searched, found, seen = sys._getframe(1), 0, [], set()
    innermost, outer = None, []  # (the function that made the call; cells masks built above it, handed to no function)
    while frame is not None and searched < FRAMES:
        code = frame.f_code
        names = _NAMES.get(code)
        if names is None:
            names = _NAMES[code] = _OUTSIDE if code.co_filename.startswith(_SKIP) or code.co_filename.startswith("<") else \
                tuple(n for n in code.co_varnames if KEEP.search(n) or PAD.search(n) or LENGTHS.search(n)
                      or CELLS.search(n) or POSITIONS.search(n))
        if names is _OUTSIDE:
            frame = frame.f_back
            continue
        searched += 1
        innermost = innermost or frame
        if names:
            variables = frame.f_locals
            for name in names:
                value = variables.get(name)
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    read = _read(name, value, code)
                    if read is not None:
                        found.append(read)
                        if read["kind"] == "cells" and HANDED.search(name) and frame is not innermost \
                                and name not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
                            outer.append((read, id(value)))
        frame = frame.f_back
    if outer and _own_mask(innermost, {held for _, held in outer}):
        found = [read for read in found if not any(read is o for o, _ in outer)]
    return found or None


def _own_mask(frame, outer: set) -> bool:
    """The function that made the call was handed a mask of its own under one of HANDED's names, and none of the cells
    masks (ids in `outer`) its callers built and handed to no function on the way: such a mask is another call's (an
    encoder-decoder's forward() builds the decoder's causal `mask` while its encoder is handed the padding alone). One
    handed down and then replaced (Megatron-LM#7039's window over the caller's `mask`) is still read."""
    code, variables = frame.f_code, frame.f_locals
    arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]  # (one it built itself is not handed it)
    own = [variables.get(name) for name in arguments if HANDED.search(name) and isinstance(variables.get(name), torch.Tensor)]
    return bool(own) and all(id(value) not in outer for value in own)


def _read(name: str, value: torch.Tensor, code) -> dict | None:
    """What `value`, held under `name` by `code`'s frame, says (the same dict while the tensor is unchanged)."""
    key = (id(value), name, code)
    held = _READ.get(key)
    if held is not None and held[0] is value and held[1] == value._version:
        return held[2]
    try:
        read = _as_padding(name, value)
    except Exception:  # noqa: BLE001 - a tensor that cannot be read here (meta, fake, sparse) holds no padding we can see
        read = None
    if read is not None:
        read = {**read, "name": name, "where": f"{code.co_name}() of {os.path.basename(code.co_filename)}"}
    if len(_READ) > 256:
        _READ.pop(next(iter(_READ)))
    _READ[key] = (value, value._version, read)  # (the tensor held: its id stays its own)
    return read


def _as_padding(name: str, value: torch.Tensor) -> dict | None:
    if value.device.type == "meta" or value.is_sparse or value.numel() > MOST or value.numel() == 0:
        return None
    if value.dim() == 1 and LENGTHS.search(name) and not value.is_floating_point() and value.dtype != torch.bool:
        return {"kind": "lengths", "rows": value.detach().cpu().numpy().astype(np.int64)}
    if POSITIONS.search(name):
        if value.dim() != 2 or value.is_floating_point() or value.dtype == torch.bool or value.shape[1] < 2:
            return None
        rows = value.detach().cpu().numpy().astype(np.int64)
        return {"kind": "positions", "rows": rows} if ((rows[:, 1:] == 0) & (rows[:, :-1] > 0)).any() else None
    if HANDED.search(name) and value.dtype == torch.bool and value.dim() == 4 and value.shape[1] == 1 \
            and value.shape[-2] > 1:  # (B, 1, Lq, Lk): one mask for every head
        return {"kind": "cells", "rows": value[:, 0].detach().cpu().numpy()}
    if CELLS.search(name) and value.dim() in (2, 3) and value.shape[-1] > 1:
        cells = value.detach().cpu().numpy()
        return {"kind": "cells", "rows": cells.astype(bool)} if np.isin(cells, (0, 1)).all() else None
    if PAD.search(name) and value.dim() == 3 and value.shape[-1] == value.shape[-2] > 1:
        # (B, L, L) named as padding, True = hidden for padding: a token's own cell is hidden exactly where it is padding,
        # however its rows were laid (a key mask repeated over the queries, an outer product, or either side's)
        rows = value.diagonal(dim1=-2, dim2=-1).detach().cpu().numpy()
        return {"kind": "pad", "rows": rows.astype(bool)} if np.isin(rows, (0, 1)).all() else None
    if value.dim() != 2 or LENGTHS.search(name) or CELLS.search(name):
        return None
    rows = value.detach().cpu().numpy()
    if not np.isin(rows, (0, 1)).all():
        return None
    return {"kind": "pad" if PAD.search(name) else "keep", "rows": rows.astype(bool)}


MEMORY = ("encoder_hidden_states", "key_value_states", "context", "memory", "encoder_output", "encoder_out",
           "enc_output", "enc_out", "cross_attention_states", "encoder_states",  # another sequence handed to attend to
           "media", "image_embeds", "image_features", "vision_features", "audio_features")  # (Flamingo's, BLIP-2's...)
_MEMORY: dict = {}  # code object -> the MEMORY names among its arguments (matched once per code)
KV_FRAMES = 6  # program frames read, innermost first, up to the innermost running module's own


def kv_given(stack: list) -> tuple[str, tuple] | None:
    """('encoder_hidden_states of __call__() of x.py', its shape but the last dim) where the function attending (or one
    between it and the innermost running module's forward, that forward included) was handed another sequence: an
    argument named as a cross-attention's memory (MEMORY) holding a tensor that is none of its other arguments
    (diffusers' processor sets `encoder_hidden_states = hidden_states` for self-attention; lucidrains' `context =
    default(context, x)`). The first such function decides: None where it holds None or the queries' own tensor
    (self-attention), or none is found. The shape lets checks/context.cross ask whether the keys are that memory's
    (a joint attention, SD3's or Qwen-Image's, concatenates it with the queries' own tokens: self-attention)."""
    module = stack[-1] if stack else None
    for frame in program_frames(sys._getframe(1), KV_FRAMES):
        code = frame.f_code
        names = _MEMORY.get(code)
        if names is None:
            arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            names = _MEMORY[code] = tuple(name for name in arguments if name in MEMORY)
        if names:
            variables = frame.f_locals
            arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            others = [variables.get(n) for n in arguments if n not in names]
            for name in names:
                value = variables.get(name)
                if not isinstance(value, torch.Tensor):
                    continue
                if any(value is other for other in others):
                    return None  # (the queries' own tensor handed as the memory: self-attention)
                return f"{name} of {code.co_name}() of {os.path.basename(code.co_filename)}", tuple(value.shape[:-1])
            return None  # (no memory handed: self-attention, said by the function that takes one)
        if module is not None and code.co_name == "forward" and code.co_argcount and code.co_varnames[0] == "self" \
                and frame.f_locals.get("self") is module:
            return None  # (the innermost running module's forward: what called it speaks for another call)
    return None


CROSS_FIELDS = ("attention_type", "attn_type", "is_cross_attention")
INNERMOST = 4  # running modules read, innermost first (a whole model's attributes speak for no one call)
CROSS_CLASS = re.compile(r"cross_?att(?:n|ention)\d*$|(?:^|_)x_?att(?:n|ention)\d*$", re.IGNORECASE)


def cross_class(stack: list) -> str | None:
    """The innermost running module's class name where it names a cross-attention (OpenFlamingo's
    `MaskedCrossAttention`, Mllama's `MllamaTextCrossAttention`); None otherwise. Weaker than cross_said: LDM's
    `CrossAttention` class runs its self-attention too (attn1, no context), so checks/context.cross believes it only
    where the keys are not as many as the queries."""
    if not stack:
        return None
    name = type(stack[-1]).__name__
    return name if CROSS_CLASS.search(name) and stack[-1].__dict__.get("is_cross_attention") is not False else None


def cross_said(stack: list) -> str | None:
    """'path.attention_type=cross' where one of the innermost running modules states itself a cross-attention:
    `attention_type` / `attn_type` "cross" (Transformer Engine's, Megatron's AttnType.cross_attn) or
    `is_cross_attention=True` (transformers' BERT family, diffusers' Attention); None otherwise."""
    for module in reversed(stack[-INNERMOST:]):
        own = vars(module)
        for name in CROSS_FIELDS:
            value = own.get(name)
            if value is True and name == "is_cross_attention" or value is not None and not isinstance(value, bool) \
                    and "cross" in str(getattr(value, "name", value)).lower():
                return f"{type(module).__name__}.{name}={getattr(value, 'name', value)!r}"
            if value is False and name == "is_cross_attention":
                return None  # (said self-attention, innermost first)
    return None


CONTEXT = ("context", "encoder_hidden_states", "key_value_states", "encoder_output", "encoder_outputs", "enc_output",
           "memory", "cross_attn_states")  # a forward argument naming the other sequence its keys are read from
CONTEXT_MASKS = ("context_mask", "encoder_attention_mask", "encoder_mask", "memory_mask", "memory_key_padding_mask",
                 "encoder_padding_mask", "cross_attn_mask", "enc_mask")  # the mask of that other sequence's keys
_CONTEXT_NAMES: dict = {}  # code object -> its parameters named as CONTEXT (matched once per code)


def _owns_weights(module) -> bool:
    """Whether `module` or one inside it holds a parameter: next(module.parameters(), None) is not None, by its
    modules' own dicts (parameters() hashes every tensor it passes: tens of us, at every attention call)."""
    pending = [module]
    while pending:  # (in any order: only whether one is there)
        found = pending.pop()
        if found is None:
            continue
        for value in found._parameters.values():
            if value is not None:
                return True
        pending.extend(found._modules.values())
    return False


def cross_passed(stack: list) -> tuple[str, str | None, tuple[int, int]] | None:
    """'Class.forward(context=…)' where the innermost running module that owns weights (the attention layer that
    projects the keys, not a parameter-free attend/kernel wrapper inside it) was handed a tensor under one of CONTEXT's
    names, other than its first input: its keys are that other sequence's (x-transformers' `Attention.forward(x,
    context=context)`), with the name of its context-mask parameter where that was handed None (the program states
    no padding of the context: checks/crosspad.py), and (x's length, the context's) along dim -2; None otherwise, or where the argument is None (self-attention)."""
    owner = next((m for m in reversed(stack[-INNERMOST:]) if _owns_weights(m)), None)
    if owner is None:
        return None
    frame, searched = sys._getframe(1), 0
    while frame is not None and searched < FRAMES:
        code = frame.f_code
        searched += 1
        names = _CONTEXT_NAMES.get(code)
        if names is None:
            params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            names = tuple(n for n in params if n in CONTEXT) if params[:1] == ("self",) else ()
            names = _CONTEXT_NAMES[code] = names and (names, tuple(n for n in params if n in CONTEXT_MASKS))
        if names and frame.f_locals.get("self") is owner:
            variables = frame.f_locals
            params = code.co_varnames[:code.co_argcount]
            first = variables.get(params[1]) if len(params) > 1 else None
            for name in names[0]:
                value = variables.get(name)
                if isinstance(value, torch.Tensor) and value is not first:
                    if not isinstance(first, torch.Tensor) or first.dim() < 2 or value.dim() < 2:
                        return None
                    unmasked = next((n for n in names[1] if variables.get(n) is None), None)
                    # (the lengths: a joint attention over [x, context] (MMDiT's) is handed it too, but its queries are
                    # both sequences, so context.cross asks that the call's queries be x's and its keys the context's)
                    return f"{type(owner).__name__}.{code.co_name}({name}=…)", unmasked, (first.shape[-2], value.shape[-2])
            return None
        frame = frame.f_back
    return None
