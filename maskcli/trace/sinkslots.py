"""Keys a kernel was handed as a window of a cache buffer that leaves out the buffer's first slots, beside the sink
the program states keeps them (read for checks/sinkslots.py).

A rolling KV cache with attention sinks (Self-Forcing, CausVid, LightX2V's lingbot, LongLive) keeps its `sink_size`
sink frames in the buffer's first sink_size x frame_seqlen slots and rolls the rest behind them, then hands the
kernel a view of the buffer, `k[attn_start:local_end]`. Where the kernel's keys are such a view (any layout: the
buffer's slot axis is the one whose stride is the key axis's) and the view starts past slot 0, the call records
(start, end, buffer slots) under "key_slots"; only then are the program's frames read for the sink, an object that
states `sink_size` with the tokens a frame (`frame_seqlen`, `frame_seq_length`, `tokens_per_frame`): its own `self`
or a local variable (trace/framebudget.py's names), and the call records (sink tokens, source) under "sink_stated".
Read off the view's sizes, strides and storage offset; nothing is copied.
"""

from __future__ import annotations

import sys

import torch

from maskcli.trace.framebudget import PER_FRAME, SINK, stated_int

FRAMES = 8  # program frames read for the sink, the kernel's caller outwards


def slots(key) -> tuple[int, int, int] | None:
    """(start, end, buffer slots) where `key` (.., Lk, D) is a window of its base's slot axis that starts past slot 0;
    None otherwise."""
    try:
        base = key._base
        if base is None or key.dim() < 3 or not key.is_floating_point():
            return None
        step, n = int(key.stride(-2)), int(key.shape[-2])
        axes = [a for a in range(base.dim()) if int(base.stride(a)) == step and int(base.shape[a]) > 1]
        if len(axes) != 1 or n < 2:
            return None
        left, where = int(key.storage_offset()) - int(base.storage_offset()), {}
        for a in sorted(range(base.dim()), key=lambda a: -int(base.stride(a))):
            stride = int(base.stride(a))
            if stride > 0:
                where[a], left = divmod(left, stride)
        axis = axes[0]
        start, length = where.get(axis, 0), int(base.shape[axis])
        if left or any(where.get(a, 0) >= int(base.shape[a]) for a in where) or start <= 0 or start + n > length:
            return None
        return start, start + n, length
    except (RuntimeError, NotImplementedError, AttributeError):  # (tensor subclasses: no view to read)
        return None


def _sink(value) -> tuple[int, str] | None:
    """(sink tokens, names) where `value` states sink frames and the tokens a frame; None otherwise."""
    try:
        sink, frame = stated_int(value, SINK, 1), stated_int(value, PER_FRAME, 1)
    except (Exception, SystemExit):  # noqa: BLE001 - the program's own code raising inside a read: not stated
        return None
    if sink is None or frame is None:
        return None
    return sink[1] * frame[1], f"{sink[0]}={sink[1]}, {frame[0]}={frame[1]}"


def stated_sink(skip: tuple) -> tuple[int, str] | None:
    """(sink tokens, source) of the first program frame, from the kernel's caller outwards, whose `self` or a local
    object states a sink of frames; None where none does."""
    frame, read_frames = sys._getframe(1), 0
    while frame is not None and read_frames < FRAMES:
        if not frame.f_code.co_filename.startswith(skip):
            read_frames += 1
            for name, value in list(frame.f_locals.items()):
                if name.startswith("_") or isinstance(value, (torch.Tensor, type)) \
                        or not (isinstance(value, dict) or hasattr(value, "__dict__")):
                    continue
                found = _sink(value)
                if found is not None:
                    return found[0], f"{found[1]} ({name}, {type(value).__name__}, in {frame.f_code.co_name}())"
        frame = frame.f_back
    return None


def note(details: dict, key, skip: tuple) -> None:
    """details["sink_slots"] = (start, end, buffer slots, sink tokens, source) where the kernel's `key` is a window of a
    buffer past its first slot and a program frame states a sink."""
    found = slots(key)
    if found is None:
        return
    sink = stated_sink(skip)
    if sink is not None:
        details["sink_slots"] = (*found, *sink)
