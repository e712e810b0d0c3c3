"""From a Mask to what the user asked for: terminal views, JSON, a saved tensor, a figure."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from maskcli.conventions import DTYPES, bytes_per_cell, cell_texts, describe, to_convention
from maskcli.errors import MaskError
from maskcli.files import atomic_write
from maskcli.masks import SAMPLES_PER_SIDE, Mask, block_shares, check_dense_fits, format_bytes
from maskcli.spec import describe as describe_params

FIGURE_MAX_CELLS = 512  # per side; a longer mask is drawn as the share of visible cells per block
TABLE_MAX_ROWS = 256  # a taller mask is a density map even when it is narrow
HEAD_COMPARE_CELLS = 1 << 22


def header(mask: Mask, convention: str, dtype: torch.dtype) -> str:
    batch, heads, q_len, k_len = mask.shape
    return (
        f"{describe_params(mask.kind, mask.params)} · shape (B={batch}, H={heads}, Lq={q_len}, Lk={k_len})\n"
        f"convention: {describe(convention, dtype)}"
    )


def head_groups(mask: Mask, batch: int) -> list[list[int]]:
    """Heads with identical masks, grouped; builtin kinds ignore h, so all heads are one group."""
    heads = mask.shape[1]
    if heads == 1 or mask.kind != "custom" or mask.shape[2] * mask.shape[3] * heads > HEAD_COMPARE_CELLS:
        return [list(range(heads))]
    keep = mask.materialize()[batch]
    groups: list[list[int]] = []
    for h in range(heads):
        for group in groups:
            if torch.equal(keep[group[0]], keep[h]):
                group.append(h)
                break
        else:
            groups.append([h])
    return groups


def _panel_title(mask: Mask, batch: int, group: list[int]) -> str:
    parts = []
    if mask.shape[0] > 1:
        parts.append(f"batch {batch}")
        if "lengths" in mask.params:
            parts[-1] += f" (length {mask.params['lengths'][batch]})"
    if mask.shape[1] > 1:
        parts.append(f"head {group[0]}" if len(group) == 1 else f"heads {_ranges(group)} (identical)")
    return ", ".join(parts)


def _ranges(values: list[int]) -> str:
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def axis_labels(mask: Mask) -> tuple[list[str], list[str]]:
    """Row labels (absolute query positions, with tokens) and column labels (key positions or tokens)."""
    _, _, q_len, k_len = mask.shape
    width = len(str(mask.q_offset + q_len - 1))
    positions = [f"{mask.q_offset + i:>{width}}" for i in range(q_len)]
    if mask.tokens is None:
        return positions, [str(k) for k in range(k_len)]
    rows = [f"{position} {mask.tokens[mask.q_offset + i]}" for i, position in enumerate(positions)]
    return rows, list(mask.tokens)


def mask_views(mask: Mask, convention: str, dtype_name: str, console) -> list:
    """Rich renderables: a header, then per batch row (and head group) a table or a density map."""
    from rich.text import Text

    from maskcli.render.density import choose_blocks, density_text
    from maskcli.render.tables import fits, mask_table

    dtype = DTYPES[dtype_name]
    batch, _, q_len, k_len = mask.shape
    texts = cell_texts(convention, dtype)
    label_width = len(str(mask.q_offset + q_len - 1)) + 1
    # every cell takes at least two columns: decide before building labels for a long mask
    maybe_table = 2 * k_len + label_width <= console.width and q_len <= TABLE_MAX_ROWS
    if maybe_table:
        row_labels, col_labels = axis_labels(mask)
        label_width = max(map(len, row_labels))
        cell_width = max(max(map(len, col_labels)), *map(len, texts)) + 1
        maybe_table = label_width + 2 + k_len * cell_width <= console.width
    views: list = [Text(header(mask, convention, dtype), style="bold")]
    for b in range(batch):
        for group in head_groups(mask, b):
            title = _panel_title(mask, b, group)
            if title:  # its own line: a table title would wrap to the table's width
                views.append(Text(title, style="bold"))
            if maybe_table:
                keep = mask.materialize()[b, group[0]].tolist()
                table = mask_table(keep, None, row_labels, col_labels, texts)
                if fits(console, table):
                    views.append(table)
                    continue
            blocks = choose_blocks(q_len, k_len, console.width - label_width - 2)
            shares, sampled = block_shares(mask, b, group[0], blocks.rows, blocks.cols)
            views.append(density_text(shares, blocks, q_len, k_len, mask.q_offset, SAMPLES_PER_SIDE if sampled else None))
    return views


def mask_json(mask: Mask) -> str:
    """One JSON object; `mask` is nested [B][H][Lq][Lk] lists of 0/1, 1 = may attend."""
    check_dense_fits(mask.shape, 12, "as JSON")
    data = {
        "kind": mask.kind,
        "name": mask.name,
        "params": mask.params,
        "shape": list(mask.shape),
        "q_offset": mask.q_offset,
        "convention": "keep",
        "mask": mask.materialize().to(torch.uint8).tolist(),
    }
    if mask.tokens is not None:
        data["tokens"] = list(mask.tokens)
    return json.dumps(data)


def save_tensor(mask: Mask, convention: str, dtype_name: str, path: Path) -> None:
    """The dense mask in `convention`, as .pt or .npy."""
    dtype = DTYPES[dtype_name]
    check_dense_fits(mask.shape, bytes_per_cell(convention, dtype) + 1, f"in the {convention} convention")
    size = math.prod(mask.shape) * bytes_per_cell(convention, dtype)
    free = shutil.disk_usage(path.parent if str(path.parent) else ".").free
    if size > free:
        raise MaskError(
            f"--save {str(path)!r} would write {format_bytes(size)} but the disk there has {format_bytes(free)} free: "
            "use a smaller --len, or --png for a picture of it"
        )
    tensor = to_convention(mask.dense(), convention, dtype)
    if path.suffix.lower() == ".pt":
        atomic_write(path, lambda temp: torch.save(tensor, temp))
    else:
        import numpy as np

        atomic_write(path, lambda temp: np.save(temp, tensor.numpy()))


def mask_figure(mask: Mask):
    """One panel per batch row (and distinct head); long masks show the visible share per block."""

    from maskcli.render.heatmaps import Panel, heatmap_figure

    batch, _, q_len, k_len = mask.shape
    rows = max(1, -(-q_len // FIGURE_MAX_CELLS))
    cols = max(1, -(-k_len // FIGURE_MAX_CELLS))
    panels = []
    for b in range(batch):
        for group in head_groups(mask, b):
            title = _panel_title(mask, b, group)
            if rows == 1 and cols == 1:
                keep = mask.materialize()[b, group[0]].cpu().numpy()
                panels.append(Panel(title, keep, *axis_labels(mask)))
                continue
            share, sampled = block_shares(mask, b, group[0], rows, cols)
            how = f"share visible, estimated from up to {SAMPLES_PER_SIDE} x {SAMPLES_PER_SIDE} points" if sampled else "share visible"
            title = (title + "\n" if title else "") + f"one pixel = {rows} queries x {cols} keys (shade = {how})"
            panels.append(Panel(title, share.numpy(), None, None, extent=(0, k_len, mask.q_offset + q_len, mask.q_offset)))
    figure_title = f"{describe_params(mask.kind, mask.params)}\nshape (B={batch}, H={mask.shape[1]}, Lq={q_len}, Lk={k_len}), keep convention"
    return heatmap_figure([panels], figure_title, ("may attend (True)", "masked (False)"))


def save_mask_figure(mask: Mask, path: Path) -> None:
    from maskcli.render.heatmaps import save_figure

    save_figure(mask_figure(mask), path)
