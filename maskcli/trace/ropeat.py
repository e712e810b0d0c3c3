"""The positions a rotary table encodes where a cached step applies it: read off the (cos, sin) its frame holds.

Where an attention call's queries are fewer than its keys (a step over a cache), the function that made the call holds
the rotary table it rotated them with (`cos, sin`, llama2.c's `freqs_cos, freqs_sin`, or `position_embeddings` as
transformers hands it; `freqs_cis`, a complex one; RoFormer's `sinusoidal_pos` or GPT-J's `sincos`, sin and cos joined
on the last axis). Each position p is encoded as angles p·f for the rotary frequencies f: the lowest frequency's angle,
over f and times a linear scaling factor where the module states one, gives p without wrapping for any length a model
holds. The frequencies are the `inv_freq` buffer of a module a program frame's `self` holds (the attention's, else the
model's around it, as transformers keeps its rotary module); without one, only a table of position 0 alone (every cos 1,
every sin 0: whatever the frequencies) is read. Read only at a cached step's call, on one column of the table (O(L),
nothing per token in Python). checks/positioned.py reads it against the keys each query sees.
"""

from __future__ import annotations

import weakref

import torch

PAIRS = (("cos", "sin"), ("cos_q", "sin_q"), ("freqs_cos", "freqs_sin"))
TUPLES = ("position_embeddings", "rotary_emb", "rotary_pos_emb")
COMPLEX = ("freqs_cis", "freqs_complex", "rope")
JOINED = (("sinusoidal_pos", True), ("sincos", True), ("sin_cos", True), ("cos_sin", False))  # (one tensor, its last
# axis the two halves, sin first where the name says so: RoFormer's sinusoidal_pos, GPT-J's and CodeGen's sincos)
FRAMES = 2  # the innermost program frames read: the attention's forward and the function it was called from
_FREQ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (inv_freq, scaling factor) or None


def _frequencies(owner) -> tuple | None:
    """(inv_freq as float64, linear scaling factor) of the first module `owner` holds with an `inv_freq` buffer."""
    if not isinstance(owner, torch.nn.Module):
        return None
    try:
        if owner in _FREQ:
            return _FREQ[owner]
    except TypeError:
        return None
    found = None
    for module in owner.modules():
        freq = module._buffers.get("inv_freq") if hasattr(module, "_buffers") else None
        if freq is None:
            freq = module.__dict__.get("inv_freq")
        if isinstance(freq, torch.Tensor) and freq.dim() == 1 and freq.numel() and freq.device.type != "meta":
            factor = getattr(module, "scaling_factor", 1.0)
            factor = float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0 else 1.0
            found = (freq.detach().double().cpu(), factor)
            break
    _FREQ[owner] = found
    return found


def _table(variables: dict):
    """(name, cos, sin) of the rotary table a frame holds, or None."""
    for c, s in PAIRS:
        cos, sin = variables.get(c), variables.get(s)
        if type(cos) is torch.Tensor and type(sin) is torch.Tensor:
            return f"{c}/{s}", cos, sin
    for name in TUPLES:
        held = variables.get(name)
        if isinstance(held, tuple) and len(held) == 2 and all(type(x) is torch.Tensor for x in held):
            return name, held[0], held[1]
    for name in COMPLEX:
        held = variables.get(name)
        if type(held) is torch.Tensor and held.is_complex():
            return name, held.real, held.imag
    for name, sin_first in JOINED:
        held = variables.get(name)
        if type(held) is torch.Tensor and held.dim() >= 1 and held.shape[-1] >= 2 and held.shape[-1] % 2 == 0:
            first, second = held.chunk(2, dim=-1)
            return (name, second, first) if sin_first else (name, first, second)
    return None


def _positions(cos: torch.Tensor, sin: torch.Tensor, freqs: tuple | None, batch: int) -> list | None:
    """The largest position the table encodes, per batch row where it has one per row (else one for all); None where it
    is no rotary table (cos² + sin² not 1) or cannot be read."""
    if cos.shape != sin.shape or cos.dim() < 1 or not cos.is_floating_point() or not cos.numel() \
            or cos.device.type == "meta":
        return None
    cos, sin = cos.detach().double(), sin.detach().double()
    width = cos.shape[-1]
    if freqs is not None and width in (freqs[0].numel(), 2 * freqs[0].numel()):
        j = int(torch.argmin(freqs[0]))
        c, s = cos[..., j].cpu(), sin[..., j].cpu()
        if (c * c + s * s - 1).abs().max() > 1e-3:
            return None
        at = torch.atan2(s, c) / float(freqs[0][j])
        m = freqs[0].numel() // 2  # (another column must agree: a layout other than transformers' halves, pairs
        turned = at * float(freqs[0][m])  # interleaved as GPT-J's, holds another frequency there: not read)
        if ((torch.cos(turned) - cos[..., m].cpu()).abs().max() > 0.05
                or (torch.sin(turned) - sin[..., m].cpu()).abs().max() > 0.05):
            return None
        at = at * freqs[1]
    else:  # (no frequencies: position 0 alone is read, every cos 1 and every sin 0; its first row tells most tables)
        if (cos.reshape(-1, width)[0] - 1).abs().max() > 1e-6:
            return None
        c, s = cos.cpu(), sin.cpu()
        if (c * c + s * s - 1).abs().max() > 1e-3 or not ((c - 1).abs().max() < 1e-6 and s.abs().max() < 1e-6):
            return None
        at = torch.zeros(c.shape[:-1], dtype=torch.float64)
    if at.dim() >= 2 and at.shape[0] == batch and batch > 1:
        return [int(round(float(x))) for x in at.reshape(batch, -1).max(dim=1).values]
    return [int(round(float(at.max())))]


def note(details: dict, walked, shape: tuple) -> None:
    """details["rope_positions"] at a call whose queries are fewer than its keys, where a program frame holds a
    rotary table: {"most": the largest position it encodes (per batch row or one), "name", "function", "rows"}."""
    if walked is None or len(shape) != 4 or not 0 < shape[2] < shape[3]:
        return
    for frame, _ in walked.held[:FRAMES]:
        variables = frame.f_locals
        found = _table(variables)
        if found is None:
            continue
        name, cos, sin = found
        freqs = next((f for f in (_frequencies(held.f_locals.get("self")) for held, _ in walked.held) if f), None)
        most = _positions(cos, sin, freqs, int(shape[0]))
        if most is not None:
            code = frame.f_code
            details["rope_positions"] = {"most": most, "name": name, "rows": int(cos.shape[-2]) if cos.dim() >= 2 else 1,
                                         "function": getattr(code, "co_qualname", code.co_name)}
        return
