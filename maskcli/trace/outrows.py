"""Each batch row of an outermost call's output hidden states, hashed: which rows a later call's memory copies.

A pipeline encodes its prompts in model calls of their own (the prompts, then classifier-free guidance's negative
prompt) and hands its transformer a memory made of their outputs repeated and concatenated (diffusers' PixArt:
`cat([negative, positive])`, each repeated per image), so the transformer's batch rows are not one encoder call's
rows one to one. A copy keeps a row's bytes: the hash of each row of the output (a model output's
`last_hidden_state`, or a (B, L, D) float tensor returned, or the first of a tuple returned), beside the hashes of the
same rows cast to the half types (a pipeline may hand its transformer the encoder's float32 output in float16 or
bfloat16), is matched against the row hashes trace/samplerows.py keeps of a later call's memory argument
(checks/memrows.py). Read once per outermost call as it returns, at most MOST elements, on the call's own device.

A module's first outermost call runs without trace's hooks (they are set inside it, at its first attention call)
and its return is watched only where it was handed a mask: where it was not (an encoder handed its ids alone, its
padding mask built inside), its return value is not seen, and its frame's locals as it returned are read instead
(returned_rows): a (B, L, D) float tensor the forward held when it returned, its output where it returns one it
named. A memory that copies none of them matches no row, as before.
"""

from __future__ import annotations

import sys

import torch

from maskcli.trace.padded import MOST
from maskcli.trace.samplerows import _rows
from maskcli.trace.unseen import unseen

HALVES = (torch.float16, torch.bfloat16)  # the casts of a float32 output also hashed


def _states(output):
    """The (B, L, D) float hidden states an output holds, or None."""
    held = output
    if not issubclass(type(held), torch.Tensor):
        held = output.get("last_hidden_state") if isinstance(output, dict) else \
            (output[0] if output else None) if isinstance(output, tuple) else getattr(output, "last_hidden_state", None)
    if issubclass(type(held), torch.Tensor) and held.dim() == 3 and held.is_floating_point() and 0 < held.numel() <= MOST \
            and held.device.type != "meta":
        return held
    return None


def returned_rows(frame) -> dict:
    """{"output_rows": {name: (one hash per batch row)}} of the (B, L, D) float tensors a returned forward's frame held
    (its locals as it returned; one batch size, the one most of them have), else {} (also where the frame still runs)."""
    try:
        live = sys._getframe()
        while live is not None:
            if live is frame:
                return {}
            live = live.f_back
        with unseen(), torch.no_grad():
            held = [(name, value) for name, value in frame.f_locals.items() if _states(value) is not None]
            if not held:
                return {}
            sizes = [value.shape[0] for _, value in held]
            batch = max(set(sizes), key=sizes.count)
            found = {}
            for name, value in held:
                if value.shape[0] == batch:
                    found.update(_hashed(value, f"{name}:"))
    except (Exception, SystemExit):  # noqa: BLE001 - the program's objects stay its own
        return {}
    return {"output_rows": found} if found else {}


def _hashed(states, prefix: str = "") -> dict:
    """{prefix + dtype name: row hashes} of a float tensor, and of its casts to the half types where it is float32."""
    found = {f"{prefix}{states.dtype}": _rows(states)}
    if states.dtype == torch.float32:
        found.update({f"{prefix}{half}": _rows(states.to(half)) for half in HALVES})
    return {name: rows for name, rows in found.items() if rows is not None}


def output_rows(output) -> dict:
    """{"output_rows": {dtype name: (one hash per batch row)}} of an outermost call's output, else {}."""
    try:
        with unseen(), torch.no_grad():
            states = _states(output)
            if states is None:
                return {}
            found = _hashed(states)
    except (Exception, SystemExit):  # noqa: BLE001 - the program's output stays its own
        return {}
    return {"output_rows": found}
