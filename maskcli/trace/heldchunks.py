"""The chunk config of a streaming encoder the program's frames hold at an attention call (checks/chunkleft.py).

Dynamic chunk training (WeNet, SpeechBrain, icefall) builds each layer's mask from a chunk size and a left context
kept in a config object or dict that the encoder's forward is handed (SpeechBrain's `DynChunkTrainConfig(chunk_size,
left_context_size)`, handed to `TransformerASR.encode` as `dynchunktrain_config`) and that is gone by the time the
layers attend: the mask builder has returned. The functions on the stack still hold it. Read at each call from the
program's frames (trace/walk.py's), by variable name (a code object's names matched once: `*config*`, `*cfg*`,
`*conf`, `*chunk*`, `hparams`): a dict, dataclass or
namespace with an int `chunk_size` > 0 and a left context, counted in chunks (`left_context_size`, SpeechBrain's
"number of chunks of left context"; `num_left_chunks`, `num_decoding_left_chunks`: WeNet's) or in frames
(`left_context_frames`: icefall's), where None means the whole past.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from maskcli.checks.configread import MISSING, read
from maskcli.trace.codes import ByCode

NAMED = re.compile(r"config|cfg|conf$|chunk|(?:^|_)hparams$")  # (not `args`: every *args function has one)
SIZES = ("chunk_size", "static_chunk_size", "decoding_chunk_size")
CHUNKS = ("left_context_size", "num_left_chunks", "left_chunks", "num_decoding_left_chunks", "left_context_chunks",
          "decoding_left_chunks")
FRAMES = ("left_context_frames",)
_NAMES = ByCode()


def held_chunks(frames: list | None) -> dict | None:
    """{"chunk", "left" (None: the whole past), "unit" (chunks | frames), "said"} of the innermost chunk config the
    program's `frames` ((frame, names) pairs, innermost first: walk.py's `held`) hold; None where none holds one."""
    for frame, _ in frames or ():
        code = frame.f_code
        names = _NAMES.get(code)
        if names is None:
            names = _NAMES.put(code, tuple(n for n in code.co_varnames if NAMED.search(n)))
        if not names:
            continue
        variables = frame.f_locals
        for name in names:
            found = _read(variables.get(name))
            if found is not None:
                field, left, unit, chunk, kind = found
                return {"chunk": chunk, "left": left, "unit": unit,
                        "said": f"{name}.{field}={left} beside chunk_size={chunk} ({kind}) in {code.co_name}()"}
    return None


def _read(value) -> tuple | None:
    """(field, left, unit, chunk size, type name) of a config with an int chunk size and a left context; else None."""
    if value is None or isinstance(value, (torch.Tensor, torch.nn.Module, str, int, float, list, tuple, type)):
        return None
    if isinstance(value, dict):
        def get(name):
            return value.get(name, MISSING)
    elif dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
        def get(name):
            return read(value, name, MISSING)
    else:
        return None
    chunk = next((c for c in map(get, SIZES) if type(c) is int and c > 0), None)
    if chunk is None:
        return None
    for fields, unit in ((CHUNKS, "chunks"), (FRAMES, "frames")):
        for field in fields:
            left = get(field)
            if left is None or type(left) is int and left >= 0:
                return field, left, unit, chunk, type(value).__name__
    return None
