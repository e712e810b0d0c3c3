"""A learned per-head sink logit the attending module holds, beside a kernel call whose softmax has no term for it
(checks/heldsinks.py).

A module that holds one learned logit per head under a sink's name (`sinks`: openai/gpt-oss's AttentionBlock,
transformers' GptOssAttention, vLLM's MiMoVisionAttention) states that each head's softmax has one more term: a sink
column joined to the scores (gpt-oss: `torch.cat([QK, S], dim=-1)`, read by trace/interface.leave_out_sink), or the
logit added to a key (MiMo's vision reference: `sinks[h]` on each sequence's first key), or a kernel's own sink
argument. SDPA and nn.MultiheadAttention take no sink argument and return no log-sum-exp to rescale their output by
afterwards, so their mask is the one way in: a per-head value in a float attn_mask. Where the module holds such a
logit (not None, one per query head of the call, not all 0; no `use_sink`-like flag of its own set False) and the
kernel's mask is none, bool, a float mask that adds nothing but 0 and its fill, or one the same for every head while
the sinks differ between heads, the call records under "sinks_dropped" what it held and what the mask was
(vllm-project/vllm#49815: MiMo's windowed vision blocks load `attn.sinks` and run flash_attn_varlen_func without it).
Read at SDPA and MHA calls only: a softmax's own scores may carry the logit added in (no column to see), and
flash/flex kernels take sinks or return the log-sum-exp a program may rescale by.
"""

from __future__ import annotations

import torch

NAMES = ("sinks", "attn_sinks", "attention_sinks", "sink_logits", "learnable_sinks", "learned_sinks")
OFF = ("use_sink", "use_sinks", "use_attn_sinks", "use_attention_sinks", "with_sinks")  # a flag the module holds
INNERMOST = 3  # running modules read, innermost first
FILL_AT_MOST = -1e4  # a float mask's value at most this masks its cell (masks._keep's reading)


def held(stack: list, heads: int) -> tuple[object, str, torch.Tensor] | None:
    """(module, name, values) of the innermost running module that holds one learned logit per head under a sink's
    name, as a float tensor of `heads` values, not all 0; None where none does or its own flag turns them off."""
    for depth, module in enumerate(reversed(stack[-INNERMOST:])):
        own = vars(module)
        params, buffers = own.get("_parameters") or {}, own.get("_buffers") or {}
        for name in NAMES:
            if name not in params and name not in own and name not in buffers:
                continue  # (every call's path: a few dict lookups a module)
            value = params.get(name, buffers.get(name, own.get(name)))
            if value is None or not issubclass(type(value), torch.Tensor) or not value.is_floating_point():
                continue
            if any(own.get(flag) is False for flag in OFF) or value.numel() != heads \
                    or depth and _attentions(own.get("_modules") or {}) > 1:
                return None  # (off; not one per head; or a block whose several attentions leave open whose sinks)
            values = value.detach().reshape(-1).float()
            if not bool(torch.isfinite(values).all()) or not bool((values != 0).any()):
                return None  # (not loaded yet, or all 0: a 0 added to a key changes nothing)
            return module, name, values
    return None


def _attentions(children: dict) -> int:
    """How many of a module's own children attend (nn.MultiheadAttention, or a class named ...Attention)."""
    return sum(isinstance(c, torch.nn.MultiheadAttention) or type(c).__name__.endswith("Attention")
               for c in children.values() if c is not None)


def _dropped(mask, api: str, varied: bool) -> str | None:
    """How the kernel's `mask` holds no per-head logit, in words; None where it may hold one."""
    if mask is None:
        return "no attn_mask"
    if not issubclass(type(mask), torch.Tensor):
        return None
    if not mask.is_floating_point():
        return f"a {'bool' if mask.dtype == torch.bool else str(mask.dtype).removeprefix('torch.')} attn_mask"
    m = mask.detach()
    biased = torch.isfinite(m) & (m > FILL_AT_MOST) & (m != 0)
    if not bool(biased.any()):
        return "a float attn_mask that adds nothing but 0 and its fill"
    if not varied:
        return None  # (the same sink for every head may be the one value it adds)
    if api == "mha":  # (N * H, Lq, Lk) or (Lq, Lk): its heads on the first axis of a 3-D mask
        same = m.dim() < 3 or m.shape[0] == 1 or torch.equal(m, m[:1].expand_as(m))
    else:
        four = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)) if m.dim() <= 4 else m.reshape(-1, *m.shape[-3:])
        same = four.shape[1] == 1 or torch.equal(four, four[:, :1].expand_as(four))
    return "a float attn_mask the same for every head" if same else None


def _first_kept(mask, api: str) -> tuple[int, int]:
    """(query, key) of the first query row of batch row 0, head 0 that keeps a key, and its first key: where the sink's
    logit would join the row (MiMo's reference adds it to the sequence's first key)."""
    if mask is None or not issubclass(type(mask), torch.Tensor):
        return 0, 0
    m = mask.detach()
    m = m.reshape(-1, *m.shape[-2:])[0] if m.dim() >= 2 else m.reshape(1, -1)
    rows = min(int(m.shape[0]), 64)  # (the first rows only: one that keeps nothing is rare)
    keep = (m[:rows] != (api == "mha")) if m.dtype == torch.bool else m[:rows] > FILL_AT_MOST  # (MHA's bool blocks)
    for q in range(rows):
        kept = keep[q].nonzero()
        if kept.numel():
            return q if m.shape[0] > 1 else 0, int(kept[0, 0])
    return 0, 0


def note(details: dict, stack: list, api: str, shape: tuple, sources: tuple) -> None:
    """details["sinks_dropped"] at an SDPA or MHA call inside a module that holds learned sinks its mask has no term
    for: {module, name, heads, values, mask, query, key}."""
    if api not in ("sdpa", "mha") or not stack or details.get("sink_column") is not None:
        return
    heads = int(shape[1])
    found = held(stack, heads)
    if found is None:
        return
    module, name, values = found
    varied = bool(values.max() != values.min())
    masks = [m for m in sources if issubclass(type(m), torch.Tensor)]  # (MHA's: attn_mask, key_padding_mask)
    said = [_dropped(m, api, varied) for m in masks] or [_dropped(None, api, varied)]
    if any(how is None for how in said):
        return
    how = said[0]
    mask = masks[0] if masks and masks[0].dim() >= 2 else None
    query, key = _first_kept(mask, api)
    details["sinks_dropped"] = {"module": type(module).__name__, "name": name, "heads": heads,
                                "values": [round(float(v), 4) for v in values[:8].tolist()], "mask": how,
                                "query": query, "key": key}
