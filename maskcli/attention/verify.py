"""Run one mask and one set of Q/K/V through every attention kernel PyTorch has, and compare.

The reference is maskcli's staged computation in float64 on the CPU. Each backend is
compared with it on the rows that see at least one key; on fully masked rows, where
backends really differ, the table says what each returned instead: zeros, NaN, the
unmasked row, the mean of V, or something else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from maskcli.attention.stages import attend
from maskcli.mask import Mask

DEFAULT_ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class Refused(Exception):
    """A backend declined these inputs; the message says why."""


@dataclass(frozen=True)
class BackendResult:
    name: str
    status: str  # ok, refused, error
    reason: str = ""
    max_diff: float | None = None
    masked_rows: str = "-"  # what the backend returned on fully masked rows
    seconds: float | None = None

    def agrees(self, atol: float) -> bool:
        return self.status != "ok" or (self.max_diff is not None and self.max_diff <= atol)


@dataclass(frozen=True)
class Problem:
    """Everything a backend needs: inputs on the device, the mask in its forms."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keep: torch.Tensor  # bool (B, H, Lq, Lk) on the device
    mask: Mask
    scale: float | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sdpa(backend_name: str) -> Callable[[Problem], torch.Tensor]:
    def run(p: Problem) -> torch.Tensor:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(p.q, p.k, p.v, attn_mask=p.keep, scale=p.scale)
            except RuntimeError as error:
                # CUDA explains each refusal in a warning; without one, torch only says no kernel fit
                reasons = [" ".join(str(w.message).split()) for w in caught]
                reason = "; ".join(r for r in reasons if r) or (
                    f"no {backend_name.lower().replace('_', ' ')} kernel accepts these inputs on {p.q.device.type}"
                    if "No viable backend" in str(error) else " ".join(str(error).split())
                )
                raise Refused(reason[:400]) from None

    return run


def _mha(p: Problem) -> torch.Tensor:
    """nn.MultiheadAttention with identity projections, block-convention attn_mask and key_padding_mask."""
    batch, heads, q_len, dim = p.q.shape
    k_len = p.k.shape[2]
    if p.scale is not None and not math.isclose(p.scale, 1 / math.sqrt(dim)):
        raise Refused(f"nn.MultiheadAttention always scales by 1/sqrt(head_dim) = {1 / math.sqrt(dim):.6g}")
    embed = heads * dim
    mha = torch.nn.MultiheadAttention(embed, heads, bias=False, batch_first=True, device=p.q.device, dtype=p.q.dtype)
    eye = torch.eye(embed, device=p.q.device, dtype=p.q.dtype)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([eye, eye, eye]))
        mha.out_proj.weight.copy_(eye)
    mha.eval()

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(batch, t.shape[2], embed)

    key_padding_mask = None
    keep = p.keep
    valid, rest = split_padding(p.mask)
    if valid is not None:
        key_padding_mask = ~torch.as_tensor(valid, device=p.q.device)
        keep = None if rest is None else torch.broadcast_to(rest.materialize(p.q.device), p.keep.shape)
    attn_mask = None
    if keep is not None:
        attn_mask = ~keep[0, 0] if bool((keep == keep[:1, :1]).all()) else ~keep.reshape(batch * heads, q_len, k_len)
    with torch.no_grad():
        out, _ = mha(tokens(p.q), tokens(p.k), tokens(p.v), key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)
    return out.reshape(batch, q_len, heads, dim).transpose(1, 2)


def split_padding(mask: Mask):
    """(key_valid (B, Lk) numpy, the mask without its padding) where the key padding of --lengths/--ids
    can go to nn.MultiheadAttention's key_padding_mask; (None, mask) where it cannot be split off."""
    from maskcli.terms import terms

    f = mask.frame
    if not f.padded:
        return None, mask
    valid = f.key_valid[:, f.k_start : f.k_end]
    if valid.shape[0] != mask.batch:  # one --ids/--lengths row beside several label rows
        valid = np.repeat(valid, mask.batch, axis=0)
    parts = terms(mask.expression)
    if len(parts) == 1 and parts[0].kind.name == "padding":
        return valid, None
    return valid, dataclasses.replace(mask, tree=mask.expression)  # the flags' padding is and-ed on last


def _flex(p: Problem) -> torch.Tensor:
    """flex_attention with the mask's own predicate, through create_block_mask (eager, unfused)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, heads, q_len, _ = p.q.shape
    k_len = p.k.shape[2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": we want the plain semantics
        try:
            block_mask = create_block_mask(p.mask.local_mask_mod(p.q.device), batch, heads, q_len, k_len, device=p.q.device)
            with contextlib.redirect_stdout(sys.stderr):  # a mask_mod's print() as flex_attention traces it
                return flex_attention(p.q, p.k, p.v, block_mask=block_mask, scale=p.scale)
        except (RuntimeError, NotImplementedError, ValueError, AssertionError) as error:
            raise Refused(" ".join(str(error).split())[:300] or type(error).__name__) from None


BACKENDS: dict[str, Callable[[Problem], torch.Tensor]] = {
    "maskcli staged": lambda p: attend(p.q, p.k, p.v, p.keep, scale=p.scale).output,
    "sdpa math": _sdpa("MATH"),
    "sdpa flash": _sdpa("FLASH_ATTENTION"),
    "sdpa efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa cudnn": _sdpa("CUDNN_ATTENTION"),
    "nn.MultiheadAttention": _mha,
    "flex_attention": _flex,
}


def classify_masked_rows(out: torch.Tensor, empty: torch.Tensor, v: torch.Tensor, unmasked: torch.Tensor, atol: float) -> str:
    """What a backend put in the rows that see no key."""
    if not empty.any():
        return "-"
    rows = out[empty.expand(out.shape[:-1])]
    if torch.isnan(rows).any():
        return "NaN"
    if torch.allclose(rows, torch.zeros_like(rows), atol=atol):
        return "zero"
    mean_v = v.mean(dim=-2, keepdim=True).expand(out.shape)[empty.expand(out.shape[:-1])]
    if torch.allclose(rows, mean_v, atol=max(atol, 1e-3)):
        return "mean of V"
    if torch.allclose(rows, unmasked[empty.expand(out.shape[:-1])], atol=max(atol, 1e-3)):
        return "the unmasked row"
    return "other"


def verify(
    mask: Mask,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    atol: float,
    repeat: int = 5,
    only: tuple[str, ...] | None = None,
) -> list[BackendResult]:
    """One row per backend: agreement on visible rows, fully masked rows, time per call."""
    device = q.device
    keep = torch.broadcast_to(mask.materialize(device), (*q.shape[:-1], k.shape[-2]))
    problem = Problem(q, k, v, keep, mask, scale)
    cpu64 = [t.detach().to("cpu", torch.float64) for t in (q, k, v)]
    keep_cpu = keep.cpu()
    reference = attend(*cpu64, keep_cpu, scale=scale).output
    unmasked = attend(*cpu64, torch.ones_like(keep_cpu), scale=scale).output
    empty = ~keep_cpu.any(dim=-1)  # (B, H, Lq)
    visible = ~empty
    results = []
    for name, backend in BACKENDS.items():
        if only is not None and name not in only:
            continue
        try:
            out = backend(problem)  # first call: warm-up, and the result we compare
            _sync(device)
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                backend(problem)
                _sync(device)
                times.append(time.perf_counter() - start)
        except Refused as refusal:
            results.append(BackendResult(name, "refused", str(refusal)))
            continue
        except Exception as error:  # a backend that breaks is reported, not allowed to stop the table
            results.append(BackendResult(name, "error", f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"))
            continue
        out64 = out.detach().to("cpu", torch.float64)
        diff = (out64 - reference).abs()[visible.expand(out64.shape[:-1])]
        max_diff = float(diff.max()) if diff.numel() else 0.0
        if diff.numel() and torch.isnan(diff).any():
            max_diff = float("nan")
        results.append(
            BackendResult(
                name,
                "ok",
                max_diff=max_diff,
                masked_rows=classify_masked_rows(out64, empty, cpu64[2], unmasked, atol),
                seconds=statistics.median(times) if times else None,
            )
        )
    return results


def results_json(results: list[BackendResult], mask: Mask, q: torch.Tensor, atol: float) -> str:
    """The verify table as one JSON object; a NaN difference is null with max_diff_is_nan true."""
    import json

    def row(r: BackendResult) -> dict:
        nan = r.max_diff is not None and math.isnan(r.max_diff)
        return {
            "backend": r.name,
            "status": r.status,
            "reason": r.reason or None,
            "max_diff": None if r.max_diff is None or nan else r.max_diff,
            "max_diff_is_nan": nan,
            "fully_masked_rows": r.masked_rows,
            "seconds_per_call": r.seconds,
            "agrees": r.agrees(atol),
        }

    return json.dumps({
        **mask.json(),
        "shape": [q.shape[0], q.shape[1], mask.frame.q_len, mask.frame.k_len],
        "device": str(q.device),
        "dtype": str(q.dtype).removeprefix("torch."),
        "atol": atol,
        "backends": [row(r) for r in results],
    })
