"""What a time-mixing convolution reads of a padded batch (read for checks/convpad.py).

A Conformer's convolution module (a depthwise Conv1d of kernel K over the frames, in wenet, torchaudio, ESPnet,
NeMo) runs over the same padded (B, C, T) frames its layer's self-attention masks by their padding: output frame t
reads input frames t - left .. t - left + (K - 1) x dilation, so the last real frames of a shorter row read padded
ones unless the program zeroed them first (wenet#223, pytorch/audio#4205). At each `F.conv1d` (wrapped while
tracing, no stack walked: nn.Conv1d calls it) of stride 1 that reaches later frames, recorded cheaply as it runs:
T, how far it reaches past a frame (`reach`), and per batch row where the row's constant tail begins (the first
frame from which every frame equals the last one: padding zeroed, or made one constant by a bias, carries nothing of
the padded content; frames that differ there do). A causal one (its own padding all on the left, reaching no later
frame: a Mamba or short-conv mixer's) is recorded too, with no tails: per batch row the runs of its frames that are all
zero (`zeros`, for every convolution), so that checks/convleft.py can tell whether the padded tokens a real one reads
carry content. Kept per outermost module call (the Top it makes: `convs`), so the rules read them beside that call's
attention masks; those that run before its first attention call (a TTS model's convolutional position embedding) wait
with the outermost module call they ran in until it attends (`adopt`). As the call finishes, each is given the 2-D
masks the call was handed, as the prefix lengths they state (`stated_frames`: checks/convpad.py places a convolution
of other rows or frames by them).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from maskcli.trace.mode import has_values

compiling = torch.compiler.is_dynamo_compiling
_CALL = torch.nn.Module._call_impl.__code__

MOST = 64  # convolutions kept per outermost module call (a model's layers: the first ones tell)


def _int(value, default: int) -> int | str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)):
        value = value[0] if len(value) == 1 else None
    return value if type(value) is int else (default if value is None else None)


def patch(trace):
    """F.conv1d (what nn.Conv1d calls) wrapped while `trace` runs, to record what it reads (module docstring) and
    nothing else: no attention call, no stack walked. What puts it back."""
    original = F.conv1d

    def conv1d(*args, **kwargs):
        local = trace._local
        if trace.active and local.traced and not local.busy and not compiling():
            trace.busy = True  # (its reads are maskcli's: no wrapper, nor the mode, takes them for the program's)
            try:
                with torch._C.DisableTorchFunction():
                    held = local.outer
                    if held is not None and held[0] is not None:
                        _read(trace._convs.setdefault(id(held), []), args, kwargs)
                    else:
                        _before(local, args, kwargs)
            except (Exception, SystemExit):  # noqa: BLE001 - nothing of the trace reaches the program
                pass
            finally:
                trace.busy = False
        return original(*args, **kwargs)

    F.conv1d = conv1d
    return lambda: setattr(F, "conv1d", original)


def _before(local, args: tuple, kwargs: dict) -> None:
    """A convolution that runs before the model call's first attention call (a TTS model's convolutional position
    embedding, before its transformer): no model call is held yet, so what it reads waits with the outermost module call
    it runs in (its _call_impl frame, found by a walk out of the frames, made only for a convolution that reads later
    frames or causally) until that call's first attention call adopts it (`adopt`). One model call waits at a time."""
    found: list = []
    _read(found, args, kwargs)
    if not found:
        return
    frame, outermost = sys._getframe(2), None
    while frame is not None:
        if frame.f_code is _CALL:
            outermost = frame
        frame = frame.f_back
    if outermost is None:
        return
    waiting = getattr(local, "conv_before", None)
    if waiting is None or waiting[0] is not outermost:
        local.conv_before = waiting = (outermost, [])
    if len(waiting[1]) < MOST:
        waiting[1].extend(found)


def adopt(trace, held: list, frame) -> None:
    """The convolutions that ran before the first attention call of the outermost module call `held`, whose frame is
    `frame` (`_before`), made its own; whatever waited for another call let go."""
    waiting = getattr(trace._local, "conv_before", None)
    if waiting is None:
        return
    trace._local.conv_before = None
    if waiting[0] is frame:
        trace._convs.setdefault(id(held), [])[:0] = waiting[1]


def _read(found: list, args: tuple, kwargs: dict) -> None:
    named = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    given = {**dict(zip(named, args)), **kwargs}
    x, weight = given.get("input"), given.get("weight")
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) \
            or x.dim() != 3 or not x.is_floating_point() or not has_values(x) or x.shape[-1] < 2:
        return
    kernel, stride = int(weight.shape[-1]), _int(given.get("stride"), 1)
    padding, dilation = _int(given.get("padding"), 0), _int(given.get("dilation"), 1)
    if len(found) >= MOST or kernel < 2 or stride != 1 or dilation is None or padding is None:
        return
    span = (kernel - 1) * dilation
    left = {"same": span // 2, "valid": 0}.get(padding) if isinstance(padding, str) else padding
    if left is None or span - left < 0:
        return
    with torch.no_grad():
        x = x.detach()
        # (what a causal one reads of left padding, checks/convleft.py: read where it is causal over its own frames or
        # over frames the program padded by hand, no padding of its own)
        zeros = zero_runs((x == 0).all(1)) if left in (0, span) else None
        if span - left == 0:  # (a causal convolution reads no later frame: its zero frames alone are read)
            found.append({"frames": int(x.shape[-1]), "reach": 0, "kernel": kernel, "padding": left,
                          "dilation": dilation, "tails": (), "zeros": zeros})
            return
        differs = (x[:, :, :-1] != x[:, :, -1:]).any(1)  # (B, T - 1): frame t unlike the last frame
        at = torch.arange(1, x.shape[-1], device=x.device)
        tails = torch.where(differs, at, torch.zeros_like(at)).amax(1)
    found.append({"frames": int(x.shape[-1]), "reach": span - left, "kernel": kernel, "padding": left,
                  "dilation": dilation, "tails": tuple(int(t) for t in tails.tolist()), "zeros": zeros})


RUNS = 8  # runs of zero frames kept per batch row (a row of more is not read: None)


def zero_runs(zero: torch.Tensor) -> tuple:
    """Per batch row of bool (B, T) frames that are all zero, its runs [start, end) of them (at most RUNS; None for a
    row of more), found without a loop over the frames."""
    edges = torch.diff(zero.to(torch.int8), dim=1, prepend=zero.new_zeros(zero.shape[0], 1, dtype=torch.int8),
                       append=zero.new_zeros(zero.shape[0], 1, dtype=torch.int8))
    counts = (edges != 0).sum(1)
    many = (counts > 2 * RUNS).tolist()
    at = torch.nonzero(edges[~(counts > 2 * RUNS)]).tolist()  # (one read of the rows kept, not one per row)
    kept: list = [[] for _ in range(len(many) - sum(many))]
    for row, t in at:
        kept[row].append(t)
    found, rows = [], iter(kept)
    for more in many:
        edge = None if more else next(rows)
        found.append(None if more else tuple(zip(edge[::2], edge[1::2])))
    return tuple(found)


def stated_frames(convs: list, module, args: tuple, kwargs: dict) -> None:
    """Each convolution of a finished model call given `stated`: each row's real frames as the call's own 2-D masks
    (any name with `mask` in it; bool or 0/1 integers, (B, T)) state them, where a row's real frames are a prefix of
    it, in either polarity (True = real: `self_attn_mask`, `lens_to_mask`; True = padding: `key_padding_mask`) — a
    tuple ((B, T), lengths) each, read once per call (checks/convpad.py maps a convolution's frames onto the
    attention's keys by them, where its rows or frames are not the attention's)."""
    from maskcli.trace.tops import _given

    found = []
    for name, value in _given(module, args, kwargs)[1].items():
        if "mask" not in name.lower() or not issubclass(type(value), torch.Tensor) or value.dim() != 2 \
                or value.is_floating_point() or value.numel() > 1 << 20 or value.device.type == "meta":
            continue
        flags = value.detach()
        if flags.dtype != torch.bool:
            if not bool(((flags == 0) | (flags == 1)).all()):
                continue
            flags = flags.bool()
        for real in (flags, ~flags):
            counts = real.sum(1)
            prefix = torch.arange(real.shape[1], device=real.device)[None] < counts[:, None]
            if bool((prefix == real).all()):
                found.append((tuple(real.shape), tuple(int(n) for n in counts.tolist())))
    for conv in convs:
        conv["stated"] = tuple(found)
