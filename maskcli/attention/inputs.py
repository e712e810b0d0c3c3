"""Queries, keys and values for attention: given, projected from embeddings, or random; device and dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maskcli.conventions import DTYPES, torch_dtype
from maskcli.errors import MaskError
from maskcli.tensorfile import is_inline, load_tensor


def available_devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def resolve_device(name: str) -> torch.device:
    """auto = cuda, then mps, then cpu; anything unavailable is a MaskError listing what is."""
    available = available_devices()
    if name == "auto":
        return torch.device("cuda" if "cuda" in available else "mps" if "mps" in available else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MaskError(f"unknown --device {name!r}: use auto or one of {', '.join(available)}") from None
    if str(device) not in available and device.type not in ("cpu",):
        raise MaskError(f"--device {name!r} is not available here; available: {', '.join(available)}")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise MaskError(f"unknown --dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return torch_dtype(name)


@dataclass(frozen=True)
class QKV:
    """(B, H, L, D) tensors on the compute device; `source` says where they came from."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    source: str


def as_4d(tensor: torch.Tensor, flag: str) -> torch.Tensor:
    """[L, D], [B, L, D] or [B, H, L, D] as [B, H, L, D]."""
    if tensor.dim() == 2:
        return tensor[None, None]
    if tensor.dim() == 3:
        return tensor[:, None]
    if tensor.dim() == 4:
        return tensor
    raise MaskError(
        f"{flag} has shape {list(tensor.shape)}: expected [L, D], [B, L, D] or [B, H, L, D]"
    )


def _float(tensor: torch.Tensor, flag: str) -> torch.Tensor:
    if tensor.device.type == "meta":
        raise MaskError(f"{flag} is a meta tensor: it has a shape {list(tensor.shape)} but no values; save a tensor with values")
    if tensor.is_quantized or tensor.layout != torch.strided:
        kind = "quantized" if tensor.is_quantized else str(tensor.layout).removeprefix("torch.")
        raise MaskError(f"{flag} is a {kind} tensor; give a plain dense tensor of numbers (.to_dense() or .dequantize() it first)")
    if tensor.is_complex() or not (tensor.is_floating_point() or tensor.dtype in (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise MaskError(f"{flag} has dtype {str(tensor.dtype).removeprefix('torch.')}; give real numbers")
    if tensor.numel() == 0:
        raise MaskError(f"{flag} is empty (shape {list(tensor.shape)}): give at least one row of numbers")
    return tensor.to(torch.float32) if not tensor.is_floating_point() else tensor


def load_input(source: str, flag: str, name: str) -> torch.Tensor:
    """One input tensor from a file or inline JSON: the one named `name` (q, k, v or x), or the file's only one."""
    others = tuple(role for role in ("q", "k", "v", "x") if role != name)  # a lone 'k' is no query
    # JSON numbers are doubles: keep them so until the compute dtype is applied
    where = flag if is_inline(source) else f"{flag} {source!r}"
    return _float(load_tensor(source, flag, (name,), others, json_floats=torch.float64), where)


def check_fits(tensor: torch.Tensor, dtype: torch.dtype, flag: str, fix: str = "scale the inputs down or compute in a wider --dtype") -> None:
    """Refuse finite values that `dtype` cannot hold: they would turn to inf before any stage is computed."""
    if not tensor.is_floating_point() or torch.finfo(tensor.dtype).max <= torch.finfo(dtype).max:
        return
    largest = torch.finfo(dtype).max
    beyond = torch.isfinite(tensor) & (tensor.abs() > largest)
    if bool(beyond.any()):
        value = tensor[beyond][0].item()
        name = str(dtype).removeprefix("torch.")
        raise MaskError(f"{flag} holds {value:g}, beyond what {name} holds (largest {largest:.6g}): {fix}")


def project(x: torch.Tensor, seed: int, d_out: int | None, heads: int, bias: bool) -> tuple[torch.Tensor, ...]:
    """Q, K, V as tutorial code makes them: after torch.manual_seed(seed), nn.Linear(d_in, d_out)
    for query, key and value in that order; heads split d_out as (H, d_out / H)."""
    x3 = x if x.dim() == 3 else x[None]
    d_in = x3.shape[-1]
    d_out = d_in if d_out is None else d_out
    if d_out < 1:
        raise MaskError(f"--d-out must be at least 1 (the size of each projection), got {d_out}")
    if d_out % heads:
        raise MaskError(f"--d-out {d_out} does not split into --heads {heads}: make d_out a multiple of heads")
    check_fits(x3, torch.float32, "--x", "scale the embeddings down (they are projected in float32, as tutorial code does)")
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(d_in, d_out, bias=bias) for _ in range(3)]
    batch, length, _ = x3.shape
    with torch.no_grad():
        outs = [layer(x3.to(torch.float32)) for layer in layers]
    return tuple(o.view(batch, length, heads, d_out // heads).transpose(1, 2) for o in outs)


@dataclass(frozen=True)
class Given:
    """Inputs the user gave: q, k and v, or embeddings x; loaded but not yet projected."""

    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    x: torch.Tensor | None = None

    def query_length(self, offset: int) -> int:
        """Queries: rows of q; with x, the rows after the first `offset` (already in the cache)."""
        return self.q.shape[-2] if self.x is None else self.x.shape[-2] - offset


def load_given(q: str | None, k: str | None, v: str | None, x: str | None) -> Given | None:
    """--q/--k/--v (all three) take precedence over --x; None when nothing was given."""
    given = {"--q": q, "--k": k, "--v": v}
    if any(value is not None for value in given.values()):
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise MaskError(f"give all of --q, --k and --v (missing {', '.join(missing)}), or use --x or random inputs")
        return Given(*(as_4d(load_input(value, flag, flag[2:]), flag) for flag, value in given.items()))
    if x is not None:
        xt = load_input(x, "--x", "x")
        if xt.dim() not in (2, 3):
            raise MaskError(f"--x has shape {list(xt.shape)}: expected [L, d_in] or [B, L, d_in]")
        return Given(x=xt)
    return None


def make_qkv(
    given: Given | None,
    *,
    seed: int,
    batch: int,
    heads: int,
    head_dim: int,
    d_out: int | None,
    qkv_bias: bool,
    q_len: int,
    k_len: int,
) -> QKV:
    """Q, K, V (B, H, L, D): as given, projected from x, or random from the seed.

    With x the keys and values cover every row of x and the queries are its last
    q_len rows (the new tokens of a prefill).
    """
    if given is not None and given.x is None:
        return QKV(given.q, given.k, given.v, source="given --q/--k/--v")
    if given is not None:
        rows = given.x.shape[-2]
        if rows != k_len:  # checked here: slicing the last q_len rows of too few would hide the real mismatch
            raise MaskError(
                f"--x has {rows} rows (dim -2, one per token) but the mask has {k_len} key positions: "
                "match --len/--offset/labels to the inputs"
            )
        qf, kf, vf = project(given.x, seed, d_out, heads, qkv_bias)
        return QKV(qf[:, :, kf.shape[2] - q_len :], kf, vf, source=f"--x projected by nn.Linear after torch.manual_seed({seed})")
    if head_dim < 1 or batch < 1:
        raise MaskError(f"--head-dim and --batch must be at least 1, got {head_dim} and {batch}")
    generator = torch.Generator().manual_seed(seed)
    shape_q = (batch, heads, q_len, head_dim)
    shape_kv = (batch, heads, k_len, head_dim)
    return QKV(
        torch.randn(shape_q, generator=generator),
        torch.randn(shape_kv, generator=generator),
        torch.randn(shape_kv, generator=generator),
        source=f"random, torch.Generator().manual_seed({seed})",
    )


def check_against_mask(qkv: QKV, shape: tuple[int, int, int, int]) -> QKV:
    """Broadcast batch and heads against the mask's (B, H, Lq, Lk); name the dimension that disagrees."""
    batch, heads, q_len, k_len = shape
    q_shape, k_shape, v_shape = qkv.q.shape, qkv.k.shape, qkv.v.shape
    if q_shape[:3] == (batch, heads, q_len) and k_shape[:3] == v_shape[:3] == (batch, heads, k_len) and q_shape[3] == k_shape[3]:
        return qkv  # already the mask's sizes: the checks below cost more than the attention on a small mask
    checks = (
        ("query length (dim -2 of q)", q_shape[2], q_len),
        ("key length (dim -2 of k)", k_shape[2], k_len),
        ("value length (dim -2 of v)", v_shape[2], k_len),
    )
    for what, got, want in checks:
        if got != want:
            raise MaskError(f"inputs' {what} is {got} but the mask has {want}: match --len/--offset/labels to the inputs")
    if q_shape[-1] != k_shape[-1]:
        raise MaskError(f"q and k head sizes differ ({q_shape[-1]} vs {k_shape[-1]}, dim -1): they must match")
    if k_shape[:2] != v_shape[:2]:
        raise MaskError(f"k and v batch/heads differ ({list(k_shape[:2])} vs {list(v_shape[:2])})")
    out_b = max(q_shape[0], k_shape[0], batch)
    out_h = max(q_shape[1], k_shape[1], heads)
    for what, sizes, want, mask_from in (
        ("batch (dim 0)", (q_shape[0], k_shape[0], batch), out_b, "the rows of --lengths/--ids"),
        ("heads (dim 1)", (q_shape[1], k_shape[1], heads), out_h, "--heads"),
    ):
        if any(size not in (1, want) for size in sizes):
            raise MaskError(
                f"{what} does not agree: q {sizes[0]}, k/v {sizes[1]}, mask {sizes[2]} (from {mask_from}); "
                f"each must be 1 or {want}"
            )
    if q_shape[:2] == k_shape[:2] == (out_b, out_h):
        return qkv

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.expand(out_b, out_h, *t.shape[2:])

    return QKV(expand(qkv.q), expand(qkv.k), expand(qkv.v), qkv.source)
