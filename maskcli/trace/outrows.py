"""Each batch row of an outermost call's output hidden states, hashed: which rows a later call's memory copies.

A pipeline encodes its prompts in model calls of their own (the prompts, then classifier-free guidance's negative
prompt) and hands its transformer a memory made of their outputs repeated and concatenated (diffusers' PixArt:
`cat([negative, positive])`, each repeated per image), so the transformer's batch rows are not one encoder call's
rows one to one. A copy keeps a row's bytes: the hash of each row of the output (a model output's
`last_hidden_state`, or a (B, L, D) float tensor returned, or the first of a tuple returned), beside the hashes of the
same rows cast to the half types (a pipeline may hand its transformer the encoder's float32 output in float16 or
bfloat16), is matched against the row hashes trace/samplerows.py keeps of a later call's memory argument
(checks/memrows.py). Read once per outermost call as it returns, at most MOST elements, on the call's own device.
"""

from __future__ import annotations

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


def output_rows(output) -> dict:
    """{"output_rows": {dtype name: (one hash per batch row)}} of an outermost call's output, else {}."""
    try:
        with unseen(), torch.no_grad():
            states = _states(output)
            if states is None:
                return {}
            found = {str(states.dtype): _rows(states)}
            if states.dtype == torch.float32:
                found.update({str(half): _rows(states.to(half)) for half in HALVES})
    except (Exception, SystemExit):  # noqa: BLE001 - the program's output stays its own
        return {}
    return {"output_rows": {name: rows for name, rows in found.items() if rows is not None}}
