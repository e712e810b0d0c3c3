"""A float attn_mask whose finite fill the scores outgrow: the cells it masks keep softmax weight in the kernel.

An additive mask states which cells are masked by lowering them (a fill at most -1e4: BERT's `-10000.0`, an engine's
`kMaskedScore = -1e4`). That holds beside ordinary scores, a few tens apart; where the scores q @ kᵀ · scale of a row
lie further apart than the fill is deep (a converted checkpoint's outlier activations, GPT-NeoX / Pythia logits in the
thousands), a masked cell's score plus the fill still beats the kept ones and the softmax gives it weight
(NVIDIA/TensorRT-Model-Connect#695: GptNeoxKvCache filled with -1e4, future tokens and empty cache slots leaked).

Read at an SDPA call handed such a mask: first a bound that costs O(L · D), the largest |q| · |k| · scale, which
most calls stop at (their scores cannot span the fill); only then the scores themselves, softmax over them with the
mask added as the kernel does, and the weight each query row gives the cells the mask lowers (details["fill_leak"]
where some row gives them at least LEAK of its weight: per batch row and query, over the heads, whether it does, the
masked key it weighs most, its weight on masked keys, and how far that key's score is above the best one it keeps). Calls of more than MOST score cells are not read.
"""

from __future__ import annotations

import math
import weakref

import torch

from maskcli.inspect.polarity import SENTINEL_AT_MOST

MOST = 1 << 22  # score cells computed at most
LEAK = 0.01  # a query row's weight on masked cells that says the fill masks too little
MARGIN = 40.0  # exp(-40) ~ 4e-18: a masked cell this far below its row's best kept score gets no weight to speak of


def fill_leak(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale, enable_gqa: bool) -> dict:
    """{"fill_leak": {...}} where the finite fill of the float `mask` leaves masked cells softmax weight, else {}."""
    if not mask.is_floating_point() or q.dim() != 4 or k.dim() != 4 or mask.dim() > 4 or q.device.type == "meta" \
            or q.is_complex() or not q.is_floating_point():
        return {}
    try:
        return _leak(q, k, mask.detach(), scale, enable_gqa)
    except RuntimeError:  # (shapes SDPA itself refuses, tensor subclasses: nothing read)
        return {}


_WEAKEST: dict = {}  # id(mask) -> (a weak reference to it, its version, its shallowest fill): every layer is handed one


def _weakest(m: torch.Tensor) -> float | None:
    """The shallowest finite fill of `m` (its largest value at most -1e4), None where it has none; read once per mask."""
    held = _WEAKEST.get(id(m))
    if held is not None and held[0]() is m and held[1] == m._version:
        return held[2]
    lowered = (m <= SENTINEL_AT_MOST) & torch.isfinite(m)
    value = float(m[lowered].max()) if bool(lowered.any()) else None
    if len(_WEAKEST) > 64:
        _WEAKEST.clear()
    _WEAKEST[id(m)] = (weakref.ref(m), m._version, value)
    return value


def _leak(q: torch.Tensor, k: torch.Tensor, m: torch.Tensor, scale, enable_gqa: bool) -> dict:
    with torch.no_grad():
        weakest = _weakest(m)  # (the shallowest fill: the cell a score can most easily lift back)
        if weakest is None:
            return {}
        lowered = (m <= SENTINEL_AT_MOST) & torch.isfinite(m)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        qn, kn = q.detach().float().norm(dim=-1).max(), k.detach().float().norm(dim=-1).max()
        if 2 * float(qn * kn) * abs(scale) < -weakest - MARGIN:
            return {}  # (no two scores lie as far apart as the fill is deep: most calls stop here)
        b, h, lq, lk = torch.broadcast_shapes(q.shape[:-2] + (q.shape[-2], 1), k.shape[:-2] + (1, k.shape[-2]),
                                              m.shape if m.dim() == 4 else (1,) * (4 - m.dim()) + tuple(m.shape))
        if b * h * lq * lk > MOST:
            return {}
        keys = k.detach().float()
        if enable_gqa and keys.shape[1] != q.shape[1] and q.shape[1] % keys.shape[1] == 0:
            keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        raw = (q.detach().float() @ keys.transpose(-1, -2)) * scale
        weights = (raw + m.float()).softmax(-1)
        masked = lowered.broadcast_to(weights.shape)
        on_masked = (weights * masked).sum(-1)  # (B, H, Lq): each row's weight on the cells the mask lowers
        leaking = (on_masked >= LEAK) & (~masked).any(-1)  # (a row masked whole is uniform over any finite fill: not this)
        if not bool(leaking.any()):
            return {}
        worst = torch.where(masked, weights, torch.zeros((), dtype=weights.dtype)).amax(1)  # (B, Lq, Lk) over heads
        key = worst.argmax(-1)  # (B, Lq): the masked key each query row weighs most, in some head
        raw = raw.broadcast_to(weights.shape)
        kept_best = torch.where(masked, torch.full((), -math.inf), raw).amax(-1)  # (B, H, Lq): the best key kept
        at_key = raw.gather(-1, key[:, None, :, None].expand(*weights.shape[:3], 1))[..., 0]
        above = torch.where(kept_best > -math.inf, at_key - kept_best, torch.full((), -math.inf)).amax(1)  # (B, Lq)
        return {"fill_leak": {"value": weakest, "rows": leaking.any(1).cpu().numpy(), "key": key.cpu().numpy(),
                              "weight": on_masked.amax(1).cpu().numpy(), "above": above.cpu().numpy()}}
