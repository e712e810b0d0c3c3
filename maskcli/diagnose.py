"""What is this mask tensor? Its convention, how its shape broadcasts, which APIs take it,
which maskcli kind it is (checked by rebuilding it), and what looks wrong with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from maskcli.checks import Finding, mask_findings, spans
from maskcli.errors import MaskError
from maskcli.masks import build
from maskcli.spec import make_spec

SENTINEL_AT_MOST = -1e4  # a finite fill this negative is a "min"-style mask value, not a bias


@dataclass(frozen=True)
class Convention:
    name: str  # keep, block, additive, min, int, bias
    sure: bool
    note: str
    sentinel: float | None = None  # the masked value of a min-style mask


@dataclass(frozen=True)
class Structure:
    kind: str | None  # a maskcli kind, or None when nothing matched
    options: dict = field(default_factory=dict)  # make_spec keyword arguments
    command: str | None = None
    note: str = ""


def check_maskable(tensor: torch.Tensor, where: str) -> None:
    if tensor.is_complex():
        raise MaskError(f"{where} holds complex numbers ({str(tensor.dtype).removeprefix('torch.')}), which cannot be a mask")
    if tensor.dim() > 4:
        raise MaskError(f"{where} has {tensor.dim()} dimensions {list(tensor.shape)}: a mask has at most 4 (B, H, Lq, Lk)")
    if tensor.dim() < 2:
        raise MaskError(
            f"{where} has shape {list(tensor.shape)}: a mask needs at least 2 dimensions (Lq, Lk); "
            "a key padding mask is [B, S]"
        )
    if tensor.numel() == 0:
        raise MaskError(f"{where} is empty (shape {list(tensor.shape)})")


def _diagonal(tensor: torch.Tensor) -> torch.Tensor:
    """Cells (q, q + Lk - Lq): where a query sees itself, for square and bottom-right (prefill) masks."""
    q_len, k_len = tensor.shape[-2:]
    offset = max(0, k_len - q_len)
    return torch.diagonal(tensor, offset=offset, dim1=-2, dim2=-1)


def classify(tensor: torch.Tensor) -> Convention:
    """The tensor's convention, from its dtype and values; a bool mask's polarity from its structure."""
    if tensor.dtype == torch.bool:
        if bool(tensor.all()) or not bool(tensor.any()):
            value = bool(tensor.flatten()[0])
            return Convention("keep", False, f"every cell is {value}: as keep that is {'no mask' if value else 'everything masked'}, as block the opposite")
        diagonal = _diagonal(tensor).float().mean().item()
        if diagonal != 0.5:
            name = "keep" if diagonal > 0.5 else "block"
            share = diagonal if name == "keep" else 1 - diagonal
            return Convention(
                name,
                share >= 0.75,
                f"read as {name} (True = {'attend' if name == 'keep' else 'masked'}), {share:.0%} of the queries see "
                "their own position, as queries normally do",
            )
        first = tensor[..., 0].float().mean().item()
        name = "keep" if first >= 0.5 else "block"
        return Convention(name, False, "the diagonal does not tell; read from the first key, which is usually not padding")
    if not tensor.is_floating_point():
        values = torch.unique(tensor)
        if bool(((values == 0) | (values == 1)).all()):
            return Convention("int", True, "integers 0/1, 1 = attend (torch.tril(torch.ones(L, L)) style)")
        raise MaskError(f"integer values {values[:6].tolist()} are not a 0/1 mask; masks are bool, 0/1 or float")
    values = torch.unique(tensor.float())
    finite = values[torch.isfinite(values)]
    if bool(torch.isnan(values).any()):
        raise MaskError("the mask holds NaN values; a float mask is 0 where attending and -inf or a large negative number elsewhere")
    if bool((values == float("-inf")).any()) and bool((finite == 0).all()):
        return Convention("additive", True, "float 0 / -inf, added to the scores")
    negatives = finite[finite < 0]
    if bool(((finite == 0) | (finite == 1)).all()) and not bool(torch.isinf(values).any()):
        if len(finite) == 1 and finite[0] == 0:
            return Convention("additive", False, "every value is 0: as an additive mask that masks nothing")
        return Convention("int", True, "float 0/1, 1 = attend (torch.tril(torch.ones(L, L)) style)")
    if len(negatives) == 1 and bool(((finite == 0) | (finite == negatives[0])).all()) and negatives[0] <= SENTINEL_AT_MOST:
        sentinel = negatives[0].item()
        which = "finfo(" + str(tensor.dtype).removeprefix("torch.") + ").min" if sentinel == torch.finfo(tensor.dtype).min else (
            "finfo(float32).min" if sentinel == torch.finfo(torch.float32).min else f"{sentinel:g}"
        )
        return Convention("min", True, f"float 0 / {which}, added to the scores (Hugging Face eager style)", sentinel)
    return Convention("bias", False, "float values other than 0 and one fill value: an additive bias (ALiBi, relative positions), not a mask")


def to_keep(tensor: torch.Tensor, convention: Convention | str) -> torch.Tensor:
    """The bool keep mask (True = may attend) that a tensor in `convention` means."""
    name = convention if isinstance(convention, str) else convention.name
    if name == "keep":
        return tensor.bool() if tensor.dtype != torch.bool else tensor
    if name == "block":
        return ~(tensor.bool() if tensor.dtype != torch.bool else tensor)
    if name == "int":
        return tensor != 0
    return torch.isfinite(tensor) & (tensor > SENTINEL_AT_MOST)  # additive, min, bias


def broadcast_4d(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(B, H, Lq, Lk) as SDPA broadcasts it, and how the dimensions were read."""
    if tensor.dim() == 2:
        return tensor[None, None], f"[Lq={tensor.shape[0]}, Lk={tensor.shape[1]}] broadcasts over batch and heads"
    if tensor.dim() == 3:
        n = tensor.shape[0]
        return tensor[None], (
            f"[{n}, Lq={tensor.shape[1]}, Lk={tensor.shape[2]}]: SDPA broadcasts its first dimension as {n} heads "
            f"(the same for every batch row); nn.MultiheadAttention reads it as batch x heads = {n}"
        )
    return tensor, f"[B={tensor.shape[0]}, H={tensor.shape[1]}, Lq={tensor.shape[2]}, Lk={tensor.shape[3]}]"


def api_fits(tensor: torch.Tensor, convention: Convention) -> list[str]:
    """Which attention APIs take this tensor as it is, and what each would need otherwise."""
    name, dims = convention.name, tensor.dim()
    fits = []
    if name == "keep" or name in ("additive", "min", "bias"):
        fits.append("F.scaled_dot_product_attention attn_mask: yes, as is")
    elif name == "block":
        fits.append("F.scaled_dot_product_attention attn_mask: no, SDPA reads True as attend; pass ~mask")
    else:
        fits.append("F.scaled_dot_product_attention attn_mask: no, it needs bool or float; maskcli convert --to keep")
    mha_shape = dims == 2 or dims == 3
    if name in ("block", "additive", "min"):
        fits.append(f"nn.MultiheadAttention attn_mask: {'yes, as is' if mha_shape else 'no, it takes 2-D (L, S) or 3-D (B*H, L, S)'}")
    elif name == "keep":
        fits.append("nn.MultiheadAttention attn_mask: no, MHA reads True as masked; pass ~mask")
    else:
        fits.append("nn.MultiheadAttention attn_mask: no, maskcli convert --to block")
    if dims == 2 and name in ("block", "additive", "min"):
        fits.append(f"nn.MultiheadAttention key_padding_mask: yes if its shape is [B={tensor.shape[0]}, S={tensor.shape[1]}]")
    return fits


def _rebuild(kind: str, keep: torch.Tensor, lengths: list[int] | None, **options) -> bool:
    """True when maskcli's own `kind` with these options is exactly `keep` (B, Lq, Lk)."""
    batch, q_len, k_len = keep.shape
    if lengths is not None:
        options["lengths"] = ",".join(map(str, lengths))
    try:
        spec = make_spec(kind, **options)
    except MaskError:
        return False
    if (spec.q_len, spec.k_len) != (q_len, k_len) or spec.batch not in (1, batch):
        return False
    built = build(spec).materialize()[:, 0]
    return bool(torch.equal(built.expand(batch, q_len, k_len), keep))


def _labels_from_boundaries(starts_new: list[bool]) -> str:
    label, labels = 0, []
    for i, new in enumerate(starts_new):
        if i and new:
            label += 1
        labels.append(label)
    return ",".join(map(str, labels))


def _command(kind: str, options: dict) -> str:
    flags = {"length": "--len", "offset": "--offset", "window": "--window", "prefix": "--prefix", "chunks": "--chunks",
             "diagonal": "--diagonal", "lengths": "--lengths"}
    parts = ["maskcli", "show", kind] + [f"{flags[key]} {value}" for key, value in options.items()]
    return " ".join(parts)


def recognise(keep4: torch.Tensor) -> Structure:
    """The maskcli kind (and options) that rebuilds this keep mask exactly, or kind None."""
    batch, heads, q_len, k_len = keep4.shape
    if heads > 1 and not bool((keep4 == keep4[:, :1]).all()):
        return Structure(None, note="the heads differ, and maskcli's kinds are the same for every head")
    keep = keep4[:, 0]  # (B, Lq, Lk)
    seen = keep.any(dim=1)  # (B, Lk): keys some query sees
    lengths = seen.sum(dim=1).tolist()
    prefix_shaped = all(bool(seen[b, : lengths[b]].all()) for b in range(batch))
    padded = prefix_shaped and any(n < k_len for n in lengths)
    pad = lengths if padded else None
    longest = keep[max(range(batch), key=lambda b: lengths[b])]
    offset = k_len - q_len

    def found(kind: str, **options) -> Structure | None:
        if not _rebuild(kind, keep, pad, **options):
            return None
        if pad is not None:
            options["lengths"] = ",".join(map(str, pad))
        return Structure(kind, options, _command(kind, options))

    candidates = []
    if bool(longest.all()) and pad is not None:
        candidates.append(lambda: found("padding", length=q_len))
    if offset == 0:
        candidates.append(lambda: found("causal", length=q_len))
    elif offset > 0:
        candidates.append(lambda: found("prefill", offset=offset, length=q_len))
    if offset == 0:
        width = int(longest.sum(dim=1).max())
        if 1 <= width < q_len:
            candidates.append(lambda: found("window", length=q_len, window=width))
        first = int(longest[0].sum())
        if 1 < first <= k_len:
            candidates.append(lambda: found("prefix", length=q_len, prefix=first))
        ends = [int(row.nonzero().max()) + 1 if bool(row.any()) else 0 for row in longest]
        candidates.append(lambda: found("chunk", chunks=_labels_from_boundaries([i > 0 and ends[i] != ends[i - 1] for i in range(q_len)])))
        starts = [int(row.nonzero().min()) if bool(row.any()) else -1 for row in longest]
        candidates.append(lambda: found("document", chunks=_labels_from_boundaries([i > 0 and starts[i] != starts[i - 1] for i in range(q_len)])))
        last = int(longest[0].nonzero().max()) if bool(longest[0].any()) else -1
        candidates.append(lambda: found("tril", length=q_len, diagonal=last))
    for candidate in candidates:
        structure = candidate()
        if structure is not None:
            return structure
    return Structure(None, note="no maskcli kind rebuilds it exactly")


def findings(tensor: torch.Tensor, convention: Convention, keep4: torch.Tensor, structure: Structure, heads: int | None) -> list[Finding]:
    """Fully masked rows, later keys where the kind forbids them, sentinels that overflow, a 3-D heads trap."""
    kind = structure.kind or "custom"
    offset = structure.options.get("offset", 0)
    result = mask_findings(keep4, kind, offset)
    if structure.kind is None:
        # No known kind: point at queries that see later keys when most do not (a causal mask's off-by-one).
        later = torch.triu(keep4[:, :1], diagonal=max(0, keep4.shape[-1] - keep4.shape[-2]) + 1).any(dim=-1)
        rows = later.any(dim=0).flatten().nonzero().flatten().tolist()
        if rows and len(rows) < keep4.shape[-2] / 2:
            who = f"query row {rows[0]} sees" if len(rows) == 1 else f"query rows {spans(rows)} see"
            result.append(Finding("sees-later", f"{who} later keys while the others do not: an off-by-one in a causal mask?"))
    if convention.sentinel is not None or convention.name == "bias":
        lowest = float(tensor[torch.isfinite(tensor)].min()) if bool(torch.isfinite(tensor).any()) else 0.0
        for dtype in (torch.float16, torch.bfloat16):
            if lowest < torch.finfo(dtype).min and tensor.dtype != dtype:
                cast = torch.tensor(lowest).to(dtype).item()
                result.append(Finding(
                    "sentinel-overflow",
                    f"the fill value {lowest:.6g} does not fit {str(dtype).removeprefix('torch.')} (lowest {torch.finfo(dtype).min:.6g}): "
                    f"cast to it, it becomes {cast}, so a fully masked row would give NaN",
                ))
    if tensor.dim() == 3 and heads is not None and tensor.shape[0] == heads:
        result.append(Finding(
            "3d-heads",
            f"the 3-D mask's first dimension is {heads}, the head count: SDPA applies it per head, but "
            "nn.MultiheadAttention expects batch x heads there and gives each head the wrong mask once batch > 1",
        ))
    return result
