"""A video model's rolling KV-cache budget in frames, as the program states it (read for checks/framebudget.py).

Autoregressive video diffusion (CausVid, Self-Forcing, FastVideo's causal Wan, LongLive) generates a clip block of
frames by block and keeps a rolling KV cache of `local_attn_size` frames: the sink frames it never evicts
(`sink_size`) among them, the rest the latest frames. `local_attn_size` is the cache's size (`kv_cache_size =
local_attn_size * frame_seq_length`), so no query of the model sees more than local_attn_size frames of keys,
whether its mask is the training one (block-causal over the whole clip) or the cache's at inference; -1 keeps every
frame. A frame is `frame_seqlen` tokens (frame_seq_length, tokens_per_frame).

Read where the program keeps both fields on one object: a config-like object (a dataclass, a dict, a namespace, a
class named like a config or a plan) or a module of the model (its own attributes) among the modules under the
outermost module, else among the variables of the program's frames at its call (a plan at the main module's top
level, handed to every block), else the variables of one of those frames together (a script that keeps the fields as
plain ints: Reward-Forcing's causal rollout). Several objects that state different budgets state none. An object that states the
tokens per frame and the frames of a block (`num_frame_per_block`) but no cache size states the frames alone (a
block of whole frames attends both ways: checks/causal_lm.py).
"""

from __future__ import annotations

import types

import torch

from maskcli.checks.configread import read
from maskcli.checks.intent import Stated

LOCAL = ("local_attn_size",)  # frames the rolling KV cache keeps, sink frames among them
PER_FRAME = ("frame_seqlen", "frame_seq_length", "frame_seq_len", "tokens_per_frame")
SINK = ("sink_size", "num_sink_frames")
BLOCKS = ("num_frame_per_block", "causal_block_size")  # frames generated (and attended both ways) together
FLAG = "frame_budget"  # (local_attn_size or None, tokens per frame, sink frames or None): a FLAG of checks/intent.py


def stated_int(value, names: tuple, least: int | None = None) -> tuple[str, int] | None:
    """(name, value) of the first of `names` that `value` (a dict's key, else an attribute: configread.read) states as
    an int of at least `least` (any int: None), each read once; None where none is. The program's own code raising
    inside a read propagates (the caller says what that leaves unstated)."""
    get = value.get if isinstance(value, dict) else (lambda name: read(value, name))
    for name in names:
        found = get(name)
        if type(found) is int and (least is None or found >= least):
            return name, found
    return None


def _budget(value) -> tuple | None:
    """(local_attn_size or None, tokens per frame, sink frames or None, the names read) where `value` states the tokens
    per frame and local_attn_size or the frames of a block, else None."""
    try:
        local, frame, sink = stated_int(value, LOCAL), stated_int(value, PER_FRAME, 1), stated_int(value, SINK, 0)
        blocks = stated_int(value, BLOCKS, 1)
    except (Exception, SystemExit):  # noqa: BLE001 - the program's own code raising inside a read: not stated
        return None
    if frame is None or local is None and blocks is None:
        return None
    names = ", ".join(f"{one[0]}={one[1]}" for one in (local, frame, sink, blocks) if one)
    local = None if local is None or local[1] <= 0 else local[1]  # (-1: every frame kept)
    return local, frame[1], None if sink is None else sink[1], names


def frame_budget(root, places: list | None) -> list[Stated]:
    """One Stated {FLAG: (local, per frame, sink)} for every call of `root`, where one budget is stated; [] else."""
    found = {}
    for module in root.modules():
        for name, value in [("self", module), *vars(module).items()]:
            if name != "self" and (name.startswith("_") or isinstance(value, (torch.nn.Module, torch.Tensor))):
                continue
            budget = _budget(value) if name == "self" or isinstance(value, dict) or hasattr(value, "__dict__") else None
            if budget is not None:
                label = f"{'self' if name == 'self' else 'self.' + name} of {type(module).__name__}"
                found.setdefault(budget[:3], f"{budget[3]} ({label})")
    if not found:
        own = _own_window(root)
        for where, variables in places or ():
            settings = _budget(dict(variables))  # (a script's settings, plain ints at its top level: frame_seq_length = H * W)
            if settings is not None:
                found.setdefault(settings[:3], f"{settings[3]} (variables of {where})")
            for name, value in list(variables.items()):
                if name.startswith("_") or isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType)):
                    continue
                budget = _budget(value) if isinstance(value, dict) or hasattr(value, "__dict__") else None
                if budget is not None:
                    budget = _layers_window(budget, own)
                    found.setdefault(budget[:3], f"{budget[3]} ({name}, {type(value).__name__}, {where})")
    if len(found) != 1:
        return []
    (budget, source), = found.items()
    return [Stated(source, None, {FLAG: budget})]


def _own_window(root) -> tuple | None:
    """(local_attn_size, sink frames or None, source) where the modules of `root` state a rolling window of frames
    without the tokens a frame (FastVideo's CausalWanSelfAttention: its own `local_attn_size`, `sink_size`), all one
    window; None where none states it or they differ."""
    found = {}
    for module in root.modules():
        own = vars(module)
        local, sink = own.get("local_attn_size"), next((own.get(n) for n in SINK if type(own.get(n)) is int), None)
        if type(local) is int:
            found.setdefault((local, sink), f"local_attn_size={local}{'' if sink is None else f', sink_size={sink}'} "
                                            f"(self of {type(module).__name__})")
    (key, source), = found.items() if len(found) == 1 else ((None, None),)
    return None if key is None or key[0] <= 0 else (*key, source)


def _layers_window(budget: tuple, own: tuple | None) -> tuple:
    """`budget` read off an object of the program's frames (a pipeline stage holding the model), its window replaced by
    the one the model's own layers state where they state one and the object's differs: the layers run the attention
    (FastVideo#1355: the stage read local_attn_size off `transformer.model`, absent, and kept -1 while every
    attention layer said 4)."""
    if own is None or (budget[0], budget[2]) == own[:2] or budget[2] is not None and budget[2] != own[1]:
        return budget
    return own[0], budget[1], own[1], f"{own[2]}, a frame's tokens read beside {budget[3]}"


BLOCK = "frame_block"  # (frames of a block, source): a FLAG of checks/intent.py


def frame_blocks(root, places: list | None) -> list[Stated]:
    """One Stated {BLOCK: (frames a block, source)} where the program states its video model block-causal over frames:
    a module of the model's own int `num_frame_per_block` / `causal_block_size` (FastVideo's, Self-Forcing's), else an
    object of the program's frames (a training wrapper: FastVideo's LongCatCausalModel, `self._causal_block_size`) that
    holds `root` as its one module; [] where none states it or several state different blocks."""
    found = {}
    for module in root.modules():
        for name in (*BLOCKS, *("_" + n for n in BLOCKS)):
            value = vars(module).get(name)
            if type(value) is int and value > 0:
                found.setdefault(value, f"self.{name}={value} of {type(module).__name__}")
    if not found:
        for where, variables in places or ():
            for value in list(variables.values()):
                if isinstance(value, (torch.Tensor, type, types.ModuleType, types.FunctionType)) or value is root \
                        or not hasattr(value, "__dict__"):
                    continue
                try:
                    held = [v for v in vars(value).values() if isinstance(v, torch.nn.Module)]
                except TypeError:
                    continue
                if len(held) != 1 or held[0] is not root:
                    continue  # (a wrapper of a causal student and its bidirectional teacher states neither's alone)
                for name in (*BLOCKS, *("_" + n for n in BLOCKS)):
                    own = vars(value).get(name)
                    if type(own) is int and own > 0:
                        found.setdefault(own, f"self.{name}={own} of {type(value).__name__} ({where}), which holds "
                                              f"{type(root).__name__}")
    return [Stated(source, None, {BLOCK: (frames, source)}) for frames, source in found.items()] if len(found) == 1 else []


def video_input(given: dict) -> dict:
    """{"video_input": (B, d1, d2, H, W)}: the shape of a model call's first 5-D float argument (a video latent,
    [B, C, T, H, W] or [B, T, C, H, W]; a shape only, checks/frameblocks.py reads it where frame blocks are stated)."""
    for value in given.values():
        if isinstance(value, torch.Tensor) and value.dim() == 5 and value.is_floating_point():
            return {"video_input": tuple(int(x) for x in value.shape)}
    return {}
