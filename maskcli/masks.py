"""Mask predicates, the Mask value that carries one, and materialisation.

Every mask is a FlexAttention-style predicate

    mask_mod(b, h, q_idx, kv_idx) -> bool tensor     # True = this query may attend to this key

called on broadcast index tensors, so a maskcli predicate can be handed straight to
`torch.nn.attention.flex_attention.create_mask` / `create_block_mask`. Query indices
are local (0..Lq-1) as FlexAttention passes them; a Mask's `q_offset` says which
absolute position query row 0 is (prefill with a KV cache).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from maskcli.errors import MaskError
from maskcli.spec import MaskSpec

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --- builders: each returns a small pure predicate ---------------------------------


def causal() -> MaskMod:
    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return causal_mask


def bottom_right_causal(offset: int) -> MaskMod:
    """Causal for queries that sit at absolute positions offset, offset+1, ... (KV cache)."""

    def prefill_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return prefill_mask


def tril(diagonal: int = 0) -> MaskMod:
    """The 1-cells of `torch.tril(ones, diagonal)`."""

    def tril_mask(b, h, q_idx, kv_idx):
        return kv_idx - q_idx <= diagonal

    return tril_mask


def triu(diagonal: int = 0) -> MaskMod:
    """The 1-cells of `torch.triu(ones, diagonal)`."""

    def triu_mask(b, h, q_idx, kv_idx):
        return kv_idx - q_idx >= diagonal

    return triu_mask


def sliding_window(window: int) -> MaskMod:
    """Causal; each query sees itself and the window-1 keys before it (Hugging Face's count)."""

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return sliding_window_mask


def prefix_lm(prefix: int) -> MaskMod:
    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    return prefix_lm_mask


def chunked(labels: torch.Tensor) -> MaskMod:
    """label[kv] <= label[q]: own chunk and every earlier chunk."""

    def chunk_mask(b, h, q_idx, kv_idx):
        return labels[kv_idx] <= labels[q_idx]

    return chunk_mask


def document(labels: torch.Tensor) -> MaskMod:
    """Same label only, causal inside (packed sequences)."""

    def document_mask(b, h, q_idx, kv_idx):
        return (labels[kv_idx] == labels[q_idx]) & (kv_idx <= q_idx)

    return document_mask


def key_padding(key_valid: torch.Tensor) -> MaskMod:
    """key_valid[b, kv]: False for pad keys, per batch row."""

    def padding_mask(b, h, q_idx, kv_idx):
        return key_valid[b, kv_idx]

    return padding_mask


def negate(mask_mod: MaskMod) -> MaskMod:
    def not_mask(b, h, q_idx, kv_idx):
        return ~mask_mod(b, h, q_idx, kv_idx)

    return not_mask


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """True where every predicate is True (FlexAttention's and_masks)."""

    def and_mask(b, h, q_idx, kv_idx):
        result = mask_mods[0](b, h, q_idx, kv_idx)
        for mask_mod in mask_mods[1:]:
            result = result & mask_mod(b, h, q_idx, kv_idx)
        return result

    return and_mask


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """True where any predicate is True (FlexAttention's or_masks)."""

    def or_mask(b, h, q_idx, kv_idx):
        result = mask_mods[0](b, h, q_idx, kv_idx)
        for mask_mod in mask_mods[1:]:
            result = result | mask_mod(b, h, q_idx, kv_idx)
        return result

    return or_mask


# --- the Mask value ----------------------------------------------------------------


@dataclass(frozen=True)
class Mask:
    """A predicate with what it alone does not carry: name, shape (B, H, Lq, Lk), q_offset."""

    name: str
    shape: tuple[int, int, int, int]
    mask_mod: MaskMod
    q_offset: int = 0
    kind: str = "custom"
    params: dict = field(default_factory=dict)
    tokens: tuple[str, ...] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __and__(self, other: Mask) -> Mask:
        return self._combine(other, and_masks, "and")

    def __or__(self, other: Mask) -> Mask:
        return self._combine(other, or_masks, "or")

    def _combine(self, other: Mask, combine, word: str) -> Mask:
        if self.shape[2:] != other.shape[2:] or self.q_offset != other.q_offset:
            raise MaskError(
                f"cannot combine {self.name} {self.shape[2:]} with {other.name} {other.shape[2:]}: "
                "query and key lengths must match"
            )
        for axis, x, y in (("batch", self.shape[0], other.shape[0]), ("heads", self.shape[1], other.shape[1])):
            if x != y and 1 not in (x, y):
                raise MaskError(f"cannot combine {self.name} ({axis} {x}) with {other.name} ({axis} {y}): {axis} must match or be 1")
        shape = tuple(max(x, y) for x, y in zip(self.shape, other.shape))
        return Mask(
            name=f"{self.name}_{word}_{other.name}",
            shape=shape,
            mask_mod=combine(self.mask_mod, other.mask_mod),
            q_offset=self.q_offset,
            params={**self.params, **other.params},
            tokens=self.tokens or other.tokens,
            device=self.device,
        )

    def materialize(self, q_range: range | None = None, k_range: range | None = None) -> torch.Tensor:
        """Bool (B, H, len(q_range), len(k_range)), True = may attend; one broadcast call.

        The ranges are local indices (query row 0 is absolute position q_offset).
        The whole mask is the window taken whole; the result may be a broadcast view.
        """
        _, _, q_len, k_len = self.shape
        q_range = range(q_len) if q_range is None else q_range
        k_range = range(k_len) if k_range is None else k_range
        return self._call(positions(q_range, 2, self.device), positions(k_range, 3, self.device))

    def evaluate(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """Bool (B, H, len(q_index), len(k_index)) at any local query and key positions."""
        return self._call(q_index.view(1, 1, -1, 1), k_index.view(1, 1, 1, -1))

    def _call(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        batch, heads = self.shape[:2]
        b, h = positions(range(batch), 0, self.device), positions(range(heads), 1, self.device)
        keep = torch.as_tensor(self.mask_mod(b, h, q_idx, kv_idx), device=self.device)
        return torch.broadcast_to(keep, (batch, heads, q_idx.shape[2], kv_idx.shape[3]))

    def dense(self) -> torch.Tensor:
        """The whole mask as a contiguous bool tensor, after checking that it fits in memory."""
        check_dense_fits(self.shape, 1, "as a bool tensor")
        return self.materialize().contiguous()


@functools.lru_cache(maxsize=64)
def positions(values: range, axis: int, device: torch.device) -> torch.Tensor:
    """The indices in `values` laid along `axis` of four dimensions, as a predicate receives them.

    Cached: a predicate only reads its index tensors (FlexAttention's contract for a
    mask_mod), and on a small mask making them afresh cost more than the predicate
    itself (benchmarks/attend.py).
    """
    shape = [1, 1, 1, 1]
    shape[axis] = len(values)
    return torch.arange(values.start, values.stop, values.step, device=device).view(shape)


# --- from a validated spec ---------------------------------------------------------


# kind -> its predicate from (spec, labels tensor); padding alone has none (the key padding is added below)
_KIND_MODS: dict[str, Callable[[MaskSpec, torch.Tensor | None], MaskMod | None]] = {
    "causal": lambda spec, labels: causal(),
    "tril": lambda spec, labels: tril(spec.diagonal),
    "triu": lambda spec, labels: triu(spec.diagonal),
    "padding": lambda spec, labels: None,
    "prefill": lambda spec, labels: bottom_right_causal(spec.offset),
    "chunk": lambda spec, labels: chunked(labels),
    "window": lambda spec, labels: sliding_window(spec.window),
    "prefix": lambda spec, labels: prefix_lm(spec.prefix),
    "document": lambda spec, labels: document(labels),
}


def build(spec: MaskSpec, device: str | torch.device = "cpu") -> Mask:
    """The Mask a MaskSpec describes, its predicate's tensors on `device`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # pin "cuda" to a GPU: cached indices must stay with the labels
        device = torch.device("cuda", torch.cuda.current_device())
    labels = torch.tensor(spec.labels, device=device) if spec.labels is not None else None
    kind_mod = _KIND_MODS[spec.kind](spec, labels)
    # tril/triu read as "block" mean: the 1-cells are the masked ones.
    if spec.kind in ("tril", "triu") and spec.means == "block":
        kind_mod = negate(kind_mod)
    mods = [m for m in (kind_mod,) if m is not None]
    if spec.key_valid is not None:
        mods.append(key_padding(torch.tensor(spec.key_valid, dtype=torch.bool, device=device)))
    mask_mod = mods[0] if len(mods) == 1 else and_masks(*mods)
    return Mask(
        name=spec.name,
        shape=spec.shape,
        mask_mod=mask_mod,
        q_offset=spec.offset,
        kind=spec.kind,
        params=spec.params,
        tokens=spec.tokens,
        device=device,
    )


# --- memory guard and summaries of long masks --------------------------------------


def available_memory(device: torch.device | None = None) -> int | None:
    """Bytes free now on a CUDA `device`, else of physical memory; None where it cannot be told."""
    if device is not None and device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        # memory torch's caching allocator holds but no tensor uses is free to this process too
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if count < 1024 or unit == "PiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


DENSITY_FIX = "use a smaller --len, or show it without --json/--save/--png to get a density map"


def check_dense_fits(
    shape: tuple[int, ...], bytes_per_cell: float, how: str, device: torch.device | None = None, fix: str = DENSITY_FIX
) -> None:
    """Refuse a dense (B, H, Lq, Lk) result that would not fit in the free memory of `device` (the host's by default)."""
    needed = math.prod(shape) * bytes_per_cell
    free = available_memory(device)
    if free is not None and needed > free:
        dims = " x ".join(map(str, shape))
        raise MaskError(
            f"the dense mask {dims} would need {format_bytes(needed)} ({needed:,.0f} bytes) {how}, "
            f"but only {format_bytes(free)} is free{f' on {device}' if device is not None and device.type != 'cpu' else ''}: {fix}"
        )


SAMPLES_PER_SIDE = 32  # a block larger than this many queries or keys is sampled, not counted


def _block_points(length: int, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Positions to evaluate for blocks of `block` along an axis of `length`, their weights, and points per block.

    A block of up to SAMPLES_PER_SIDE positions uses every position; a longer one uses that
    many evenly spaced positions, so the cost stops growing with the length. The last block
    may be shorter: its unused slots get weight 0.
    """
    blocks = -(-length // block)
    per = min(block, SAMPLES_PER_SIDE)
    starts = torch.arange(blocks, dtype=torch.float64)[:, None] * block
    sizes = torch.clamp(length - starts, max=block)
    used = torch.minimum(sizes, torch.tensor(float(per)))
    slots = torch.arange(per, dtype=torch.float64)[None, :]
    points = (starts + torch.floor((slots + 0.5) * sizes / used)).to(torch.int64)
    weights = (slots < used).to(torch.float64)
    return torch.minimum(points, torch.tensor(length - 1)).flatten(), weights.flatten(), per


def block_shares(mask: Mask, batch: int, head: int, rows: int, cols: int, budget: int = 1 << 24) -> tuple[torch.Tensor, bool]:
    """Share of visible cells per block of `rows` queries x `cols` keys (0..1), and whether it was sampled.

    Blocks up to SAMPLES_PER_SIDE on a side are counted exactly; larger ones are estimated
    from an even grid of sample points, so any length is summarised in bounded time and
    memory. The predicate is evaluated a band of blocks at a time, within `budget` cells.
    """
    _, _, q_len, k_len = mask.shape
    q_points, q_weights, q_per = _block_points(q_len, rows)
    k_points, k_weights, k_per = _block_points(k_len, cols)
    grid_rows, grid_cols = len(q_points) // q_per, len(k_points) // k_per
    visible = torch.zeros(grid_rows, grid_cols, dtype=torch.float64)
    k_index = k_points.to(mask.device)
    band = max(1, budget // max(1, q_per * len(k_points)))
    for first in range(0, grid_rows, band):
        last = min(grid_rows, first + band)
        rows_here = slice(first * q_per, last * q_per)
        keep = mask.evaluate(q_points[rows_here].to(mask.device), k_index)[batch, head].to("cpu", torch.float64)
        weighted = keep * q_weights[rows_here, None] * k_weights[None, :]
        visible[first:last] = weighted.view(last - first, q_per, grid_cols, k_per).sum(dim=(1, 3))
    cells = q_weights.view(grid_rows, q_per).sum(1)[:, None] * k_weights.view(grid_cols, k_per).sum(1)[None, :]
    return visible / cells, rows > q_per or cols > k_per
