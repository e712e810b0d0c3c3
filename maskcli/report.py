"""From a run of attention (Stages) to what the user asked for: tables, a figure, JSON."""

from __future__ import annotations

import json
import math

import torch

from maskcli.attention import Stages
from maskcli.checks import Finding
from maskcli.masks import Mask
from maskcli.spec import describe as describe_params

MASKED_MARK = "×"
KEY_STAGES = ("scores", "scaled", "masked", "weights")


def number(value: float, precision: int) -> str:
    """A value for a table cell; non-finite values as nan, inf, -inf; huge ones in e-notation."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 10 ** -precision / 2):
        return f"{value:.{max(1, precision - 2)}e}"
    return f"{value:.{precision}f}"


def json_number(value: float):
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _json_nested(tensor: torch.Tensor):
    values = tensor.detach().to(torch.float64).cpu().tolist()

    def convert(item):
        return [convert(x) for x in item] if isinstance(item, list) else json_number(item)

    return convert(values)


def selection(shape, batch_index: int | None, head: int | None) -> list[tuple[int, int]]:
    """The (batch, head) pairs to show: those asked for, else all when there are at most 4, else (0, 0)."""
    batch, heads = shape[0], shape[1]
    batches = [batch_index] if batch_index is not None else None
    head_list = [head] if head is not None else None
    if batches is None and head_list is None and batch * heads > 4:
        batches, head_list = [0], [0]
    return [(b, h) for b in (batches or range(batch)) for h in (head_list or range(heads))]


def run_header(mask: Mask, stages: Stages, device: torch.device, source: str) -> str:
    batch, heads, q_len, k_len = stages.keep.shape
    dtype = str(stages.scores.dtype).removeprefix("torch.")
    fill = {"-inf": "masked_fill -inf", "min": "masked_fill finfo.min", "-1e9": "masked_fill -1e9", "multiply": "softmax, then multiply by the mask and renormalise"}[stages.fill]
    extra = f" · dropout {stages.dropout}" if stages.dropout else ""
    return (
        f"attend {describe_params(mask.kind, mask.params)} · shape (B={batch}, H={heads}, Lq={q_len}, Lk={k_len}, "
        f"D={stages.output.shape[-1]})\n"
        f"device {device} · dtype {dtype} · scale {stages.scale:.6g} · fill: {fill}{extra}\n"
        f"inputs: {source}"
    )


def stage_summary(name: str, title: str, values: torch.Tensor, keep: torch.Tensor | None):
    """One line for a stage too wide for the terminal: range and counts of what it holds."""
    from rich.text import Text

    shown = values if keep is None else values[keep.expand(values.shape)]
    finite = shown[torch.isfinite(shown)]
    parts = [f"{title}: {tuple(values.shape)}"]
    if finite.numel():
        parts.append(f"min {finite.min().item():.4g}, max {finite.max().item():.4g}, mean {finite.mean().item():.4g}")
    nan = int(torch.isnan(values).sum())
    if nan:
        parts.append(f"{nan} nan")
    if keep is not None:
        parts.append(f"{int((~keep).sum())} masked cells")
    return Text(" · ".join(parts))


def stage_tables(mask: Mask, stages: Stages, names: list[str], pairs, precision: int, width: int = 10**9) -> list:
    """One rich table per chosen stage and (batch, head); masked cells red and marked ×.

    A stage whose table would be wider than `width` columns becomes a one-line summary.
    """
    from rich.text import Text

    from maskcli.output import axis_labels
    from maskcli.render.tables import MASKED_STYLE, grid_table

    row_labels, col_labels = axis_labels(mask)
    cell_width = precision + 5  # sign, a digit, point, and rich's padding of one each side
    label_width = max(map(len, row_labels)) + 2
    keep = stages.keep.cpu()
    tables = []
    for b, h in pairs:
        where = ", ".join(part for part in (f"batch {b}" if stages.keep.shape[0] > 1 else "", f"head {h}" if stages.keep.shape[1] > 1 else "") if part)
        for name in names:
            values = stages.stage(name)[b, h].detach().float().cpu()
            title = f"{name}{' — ' + where if where else ''}"
            columns = values.shape[-1]
            header_width = cell_width if name == "output" else max(cell_width + 1, max(map(len, col_labels)) + 2)
            if label_width + columns * header_width > width:
                tables.append(stage_summary(name, title, values, None if name == "output" else keep[b, h]))
                continue
            if name == "output":
                dims = [f"d{j}" for j in range(values.shape[-1])]
                tables.append(grid_table(title, row_labels, dims, lambda i, j, v=values: Text(number(v[i, j].item(), precision)), corner="q \\ dim", justify="right"))
                continue
            k = keep[b, h]

            def cell(i, j, v=values, k=k):
                text = number(v[i, j].item(), precision)
                return Text(text + MASKED_MARK, style=MASKED_STYLE) if not k[i, j] else Text(text + " ")

            tables.append(grid_table(title, row_labels, col_labels, cell, justify="right"))
    return tables


def too_wide_note():
    from rich.text import Text

    return Text("stages wider than the terminal are summarised: a smaller --precision fits more columns, --png draws them, --json prints every value", style="dim")


def findings_text(findings: list[Finding]):
    from rich.text import Text

    if not findings:
        return Text("findings: none (every query sees at least one key; every weight row sums to 1)", style="green")
    text = Text("findings:\n", style="bold yellow")
    for finding in findings:
        text.append(f"  • {finding.message}\n", style="yellow")
    return text


def stages_json(mask: Mask, stages: Stages, device: torch.device, findings: list[Finding], names: list[str]) -> str:
    data = {
        "kind": mask.kind,
        "name": mask.name,
        "params": mask.params,
        "shape": list(stages.keep.shape),
        "q_offset": mask.q_offset,
        "device": str(device),
        "dtype": str(stages.scores.dtype).removeprefix("torch."),
        "scale": stages.scale,
        "fill": stages.fill,
        "dropout": stages.dropout,
        "mask": stages.keep.to(torch.uint8).cpu().tolist(),
        "stages": {name: _json_nested(stages.stage(name)) for name in names},
        "findings": [{"code": f.code, "message": f.message} for f in findings],
    }
    return json.dumps(data)


def stages_figure(mask: Mask, stages: Stages, names: list[str], pairs, device: torch.device):
    """Rows = (batch, head) pairs, columns = stages; masked cells grey, off the value scale."""
    import numpy as np

    from maskcli.output import axis_labels
    from maskcli.render.heatmaps import Panel, heatmap_figure

    row_labels, col_labels = axis_labels(mask)
    grid = []
    for b, h in pairs:
        keep = stages.keep[b, h].cpu().numpy()
        row = []
        for name in names:
            values = stages.stage(name)[b, h].detach().float().cpu().numpy()
            prefix = f"b{b} h{h}: " if len(pairs) > 1 else ""
            if name == "output":
                dims = [f"d{j}" for j in range(values.shape[-1])]
                row.append(Panel(prefix + name, np.ones(values.shape, dtype=bool), row_labels, dims, values=values, x_label="dimension"))
            else:
                before = name in ("scores", "scaled") or (name == "masked" and stages.fill == "multiply")
                row.append(Panel(prefix + name, keep, row_labels, col_labels, values=values, before_mask=before))
        grid.append(row)
    dtype = str(stages.scores.dtype).removeprefix("torch.")
    title = f"attend {describe_params(mask.kind, mask.params)} · {device} {dtype} · fill {stages.fill}"
    return heatmap_figure(grid, title, None)
