"""A feature-map linear attention's summary of the keys: einsum(φ(K), V) summed over the key axis, no softmax at all.

Linear attention (Katharopoulos et al.; fast-transformers' LinearAttention, Performer's FAVOR+, lucidrains'
linear-attention-transformer) never makes a (Lq, Lk) score: it maps queries and keys through a positive feature map
φ (elu + 1, relu, exp) and computes out_q = φ(q) · Σ_s φ(k_s) v_sᵀ / φ(q) · Σ_s φ(k_s). Which keys each query sees is
fixed by that one sum over s: summed over every key (`einsum("nshd,nshm->nhmd", K, V)`, `'bhnd,bhne->bhde'`), every
query sees every key, its later ones included; the causal form keeps the key axis and takes a prefix sum instead
(`einsum("nhld,nhlm->nhldm", K, V).cumsum(2)`, fast-transformers' CausalLinearAttention), which this does not read.

An einsum of two operands is read as that summary where (the cheap test, on the equation alone, before any frame
is read) exactly one index is summed away, it is on neither operand's last axis, each operand has exactly one index
of its own and that is its last axis (the features: φ(K)'s d and V's m), and the output keeps the rest; then where
the first operand is the feature map's output: no value below 0 (q @ kᵀ sums over the last axis, the weights @ V
product sums over the weights' last axis: neither passes). The call is recorded as a softmax reader's call would be,
(B, H, Lk, Lk) over the summed keys (self-attention: its queries are the same positions), its details saying
`by_hand` "linear": a key is seen by every query unless its φ(k) row is all 0 in that batch row and head (padding
the program zeroed: fast-transformers multiplies K by its LengthMask). Not read: φ(K) a softmax over the keys (Shen et
al.'s efficient attention, lucidrains' `k.softmax(dim=-2)`), whose `q.softmax(dim=-1)` the trace already reads by its
4-D shape as a call of its own at the same module.
"""

from __future__ import annotations

import functools

import torch

MOST = 1 << 24  # cells of φ(K) read at most (its sign, its zero rows)


@functools.lru_cache(maxsize=256)
def _summary(equation: str, ranks: tuple[int, int]) -> tuple | None:
    """(the summed index's axis in the first operand, the kept shared indexes' axes in it) of an equation that sums two
    operands' shared key axis into their last axes' outer product, else None."""
    if "->" not in equation:
        return None
    ins, out = equation.replace(" ", "").split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    counts = [rank - len(part.replace("...", "")) if "..." in part else 0 for part, rank in zip(parts, ranks)]
    if min(counts) < 0:
        return None
    pool = "".join(chr(0x100 + i) for i in range(max(counts)))  # (leading axes the equation does not name, shared
    a, b = (part.replace("...", pool[len(pool) - n:]) for part, n in zip(parts, counts))  # as they broadcast)
    out = out.replace("...", pool)
    if len(a) != ranks[0] or len(b) != ranks[1] or len(set(a)) != len(a) or len(set(b)) != len(b):
        return None
    shared = set(a) & set(b)
    summed = [c for c in shared if c not in out]
    own_a, own_b = [c for c in a if c not in b], [c for c in b if c not in a]
    if len(summed) != 1 or len(own_a) != 1 or len(own_b) != 1 or a[-1] != own_a[0] or b[-1] != own_b[0]:
        return None
    if set(out) != (shared - set(summed)) | {own_a[0], own_b[0]} or len(out) != len(set(out)):
        return None
    return a.index(summed[0]), tuple(i for i, c in enumerate(a) if c in shared and c != summed[0])


def wanted(args: tuple, kwargs: dict) -> bool:
    """The cheap test: an einsum of an equation and two floating tensors that sums their shared key axis away."""
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        args = (args[0], *args[1])
    if len(args) != 3 or not isinstance(args[0], str):
        return False
    a, b = args[1], args[2]
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not a.is_floating_point() \
            or a.dim() < 3 or a.numel() > MOST:
        return False
    found = _summary(args[0], (a.dim(), b.dim()))
    return found is not None and a.shape[found[0]] >= 2


def read(args: tuple, kwargs: dict):
    """The call of a linear attention's key summary (masks.Seen), or None where the first operand is no feature map's
    output (a value below 0)."""
    from maskcli.trace.masks import Seen, _dtype

    if not wanted(args, kwargs):
        return None
    if len(args) == 2:
        args = (args[0], *args[1])
    equation, a, b = args
    at, kept = _summary(equation, (a.dim(), b.dim()))
    features = a.detach()
    if not bool((features >= 0).all()):
        return None
    if bool(((features.sum(at) - 1).abs() < 1e-3).all()):  # φ(K) a softmax over the keys (efficient attention's
        return None  # k.softmax(dim=-2)): its q.softmax(-1) beside it is read by its shape as a call at the same
    # module, (B, H, L, d); a summary read there too would make one site's steps of two readings (checks/steps.py)
    # (B, H, Lk): a key any query sees, in each batch row and head (its φ(k) row not all 0)
    moved = features.movedim([*kept, at], list(range(len(kept) + 1)))
    rows = moved.reshape(*moved.shape[:len(kept) + 1], -1).ne(0).any(-1)
    lead = rows.shape[:-1]
    batch = lead[0] if lead else 1
    rows = rows.reshape(batch, -1, rows.shape[-1])
    heads, length = rows.shape[1], rows.shape[-1]
    keep = rows[:, :, None, :].cpu()  # (broadcast over the queries: every query the same keys)
    shape = (batch, heads, length, length)
    summed = (batch, heads, length, features.shape[-1])  # (φ(K) as (B, H, Lk, d): the queries are its positions)
    seen = Seen("softmax", shape, summed, summed, (batch, heads, length, b.shape[-1]), _dtype(a), str(a.device),
                keep=keep)
    seen.details["by_hand"] = "linear"
    seen.details["linear"] = "every key summed (no prefix sum): each query sees every key"
    return seen


read.api, read.wanted = "softmax", wanted
