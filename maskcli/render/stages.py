"""From a run of attention (Stages) to what the user asked for: tables, a figure, JSON."""

from __future__ import annotations

import json
import math

import numpy as np

import torch

from maskcli.attention.pipelines import LIKE
from maskcli.attention.stages import Stages
from maskcli.files import json_number
from maskcli.mask import Mask
from maskcli.text import Finding

MASKED_MARK = "×"
KEY_STAGES = ("scores", "scaled", "masked", "weights")


def number(value: float, precision: int) -> str:
    """A value for a table cell; non-finite values as nan, inf, -inf; huge ones in e-notation."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value != 0 and (abs(value) >= 1e5 or (precision > 0 and abs(value) < 10 ** -precision / 2)):
        return f"{value:.{max(1, precision - 2)}e}"
    return f"{value:.{precision}f}"


def json_nested(tensor: torch.Tensor):
    values = tensor.detach().to("cpu", torch.float64).tolist()  # converted on the host: no float64 copy on the device

    def convert(item):
        return [convert(x) for x in item] if isinstance(item, list) else json_number(item)

    return convert(values)


def selection(shape, batch_index: int | None, head: int | None, limit: int = 4) -> list[tuple[int, int]]:
    """The (batch, head) pairs to show: those asked for, else up to `limit` of them, in (batch, head) order.

    Left to choose, it takes head 0 of every batch row first: batch rows differ in their
    masks (padding), while heads share the mask and differ only in their inputs.
    """
    batch, heads = shape[0], shape[1]
    pairs = [
        (b, h)
        for b in ([batch_index] if batch_index is not None else range(batch))
        for h in ([head] if head is not None else range(heads))
    ]
    if batch_index is not None or head is not None:
        return pairs
    return sorted(sorted(pairs, key=lambda pair: (pair[1], pair[0]))[:limit])


def selection_note(shape, pairs, what: str, chosen: bool) -> str | None:
    """Say so when `what` (the tables, the figure) leaves (batch, head) pairs out that the user did not choose away."""
    total = shape[0] * shape[1]
    if chosen or len(pairs) == total:
        return None
    shown = ", ".join(f"b{b} h{h}" for b, h in pairs)
    return f"{what} show {shown} of {total} (batch, head) pairs (B={shape[0]}, H={shape[1]}): choose with --batch-index and --head"


def run_header(mask: Mask, stages: Stages, device: torch.device, source: str) -> str:
    batch, heads, q_len, k_len = stages.keep.shape
    dtype = str(stages.scores.dtype).removeprefix("torch.")
    extra = f" · dropout {stages.dropout}" if stages.dropout else ""
    return (
        f"attend {mask.title} · shape (B={batch}, H={heads}, Lq={q_len}, Lk={k_len}, "
        f"D={stages.output.shape[-1]})" + ("" if mask.frame.is_plain() else f" · {mask.frame.describe()}") + "\n"
        f"device {device} · dtype {dtype} · scale {stages.scale:.6g} · {_how(stages)}{extra}\n"
        f"inputs: {source}\n"
        f"cells marked {MASKED_MARK} are masked"
    )


def _how(stages: Stages) -> str:
    how = stages.pipeline
    return f"like {how.name}: {how.who}" if how.name in LIKE else f"fill: {how.who}"


def stage_formula(name: str, stages: Stages) -> str:
    """What a stage is, in one line: `weights = softmax(masked)`."""
    how = stages.pipeline
    value = "finfo.min" if how.fill == "min" else how.fill
    if name == "scaled":
        return {
            "divide": f"scaled = scores / √{stages.output.shape[-1]}",
            "split": f"scaled = (Q × √{stages.scale:.6g}) (K × √{stages.scale:.6g})ᵀ",
            "query": f"scaled = (Q × {stages.scale:.6g}) Kᵀ",
        }.get(how.scale_by, f"scaled = scores × {stages.scale:.6g}")
    if name == "unmasked":
        return "unmasked = softmax(scaled), no mask at all (to compare with the weights)"
    if name == "masked":
        if how.fill == "multiply":
            return "masked = scaled (--fill multiply masks after the softmax)"
        if how.apply == "add":
            return f"masked = scaled + mask (0 where kept, {value} where masked ×)"
        return f"masked = scaled, masked cells (×) set to {value}"
    if name == "weights":
        formula = {
            "safe": "safe_softmax(masked) (0 on rows that see no key)",
            "float32": f"softmax(masked) in float32, cast to {str(stages.weights.dtype).removeprefix('torch.')}",
        }.get(how.softmax, "softmax(masked)")
        if how.fill == "multiply":
            formula = "softmax(scaled) × mask, renormalised"
        return f"weights = {formula}" + (f", then nn.Dropout({stages.dropout})" if stages.dropout else "")
    if name == "output" and how.output == "sdpa":
        return "output = F.scaled_dot_product_attention(Q, K, V, -inf mask)"
    return {"scores": "scores = Q Kᵀ", "output": "output = weights V"}[name]


MAX_TABLE_ROWS = 64
MORE = "…"


def value_table(title: str, values: torch.Tensor, keep: torch.Tensor | None, row_labels, col_labels, precision: int,
                width: int, axis: str = "keys"):
    """A rich table of a 2-D stage (queries x keys, or x head dims): masked cells red and marked ×.

    Rows past MAX_TABLE_ROWS and the columns past `width` are left out, and a note below
    says which are shown; only the cells shown are formatted.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from maskcli.render.tables import MASKED_STYLE

    n_rows, n_cols = values.shape
    rows = min(n_rows, MAX_TABLE_ROWS)
    most = width // 3 + 1  # no column is narrower than 3 characters: only this corner leaves the device
    shown = values[:rows, :most].to("cpu", torch.float64)  # float64: finfo(float64).min must not print as -inf
    marks = None if keep is None else keep[:rows, :most].cpu()
    corner = {"keys": "q \\ kv", "dims": "q \\ dim"}[axis]
    used = max(len(corner), *(len(label) for label in row_labels[:rows])) + 2
    columns: list[tuple[str, list[Text]]] = []
    for j in range(min(n_cols, most)):
        texts = [number(value, precision) for value in shown[:, j].tolist()]
        if marks is None:
            cells = [Text(text) for text in texts]
        else:
            cells = [
                Text(text + " ") if visible else Text(text + MASKED_MARK, style=MASKED_STYLE)
                for text, visible in zip(texts, marks[:, j].tolist())
            ]
        column_width = max(len(col_labels[j]), *(len(cell) for cell in cells)) + 2
        room = width - (len(MORE) + 2 if j < n_cols - 1 else 0)  # keep room for the … column
        if columns and used + column_width > room:
            break
        used += column_width
        columns.append((col_labels[j], cells))
    table = Table(box=None)
    table.add_column(corner, justify="left", style="bold", no_wrap=True)
    for label, _ in columns:
        table.add_column(Text(label), justify="right", no_wrap=True, header_style="bold")  # a word like [/] is no markup
    if len(columns) < n_cols:
        table.add_column(MORE, no_wrap=True)
    for i in range(rows):
        table.add_row(Text(row_labels[i]), *(cells[i] for _, cells in columns), *([MORE] if len(columns) < n_cols else []))
    if rows < n_rows:
        table.add_row("⋮", *(["⋮"] * len(columns)))
    # title and note on lines of their own: a table narrower than them would fold them
    parts = [Text(title, style="italic"), table]  # the title wraps between words: the batch row it names stays readable
    cut = []
    if len(columns) < n_cols:
        cut.append(f"{axis} 0-{len(columns) - 1} of {n_cols}")
    if rows < n_rows:  # row labels start with the absolute query position (a token may follow)
        cut.append(f"queries {row_labels[0].split()[0]}-{row_labels[rows - 1].split()[0]} of {n_rows}")
    if cut:
        parts.append(Text(f"{' and '.join(cut)} shown: --png draws every cell, --json prints every value", style="dim"))
    return Group(*parts)


def stage_tables(mask: Mask, stages: Stages, names: list[str], pairs, precision: int, width: int = 10**9) -> list:
    """One rich table per chosen stage and (batch, head), each titled with what the stage is."""
    from maskcli.render.masks import axis_labels

    row_labels, col_labels = axis_labels(mask)
    batch, heads = stages.keep.shape[:2]
    tables = []
    for b, h in pairs:
        where = ", ".join(part for part in (f"batch {b}" if batch > 1 else "", f"head {h}" if heads > 1 else "") if part)
        keep = stages.keep[b, h]
        for name in names:
            values = stages.stage(name)[b, h].detach()
            title = f"{stage_formula(name, stages)}{' — ' + where if where else ''}"
            if name == "output":
                dims = [f"d{j}" for j in range(values.shape[-1])]
                tables.append(value_table(title, values, None, row_labels, dims, precision, width, axis="dims"))
            else:
                tables.append(value_table(title, values, keep, row_labels, col_labels, precision, width))
    return tables


def stages_json(mask: Mask, stages: Stages, device: torch.device, findings: list[Finding], names: list[str]) -> str:
    data = {
        **mask.json(),
        "name": mask.slug,
        "shape": list(stages.keep.shape),
        "head_dim": stages.output.shape[-1],
        "tokens": list(mask.tokens) if mask.tokens else None,
        "device": str(device),
        "dtype": str(stages.scores.dtype).removeprefix("torch."),
        "scale": stages.scale,
        "fill": stages.fill,
        "like": stages.pipeline.name if stages.pipeline.name in LIKE else None,
        "dropout": stages.dropout,
        "mask": stages.keep.cpu().to(torch.uint8).tolist(),
        "stages": {name: json_nested(stages.stage(name)) for name in names},
        "findings": [{"code": f.code, "message": f.message} for f in findings],
    }
    return json.dumps(data)


SCORE_STAGES = ("scores", "scaled", "masked")


def _finite(values, keep, everywhere: bool):
    """The finite values a panel colours: every cell before the mask, the visible ones after it."""
    shown = np.isfinite(values) & (True if everywhere else keep)
    return values[shown]


def stages_figure(mask: Mask, stages: Stages, names: list[str], pairs, device: torch.device):
    """Rows = (batch, head) pairs, columns = stages; masked cells grey, off the value scale."""
    from maskcli.render.masks import axis_labels
    from maskcli.render.heatmaps import Panel, heatmap_figure

    from maskcli.render.structure import structure

    row_labels, col_labels = axis_labels(mask)
    batch, heads = stages.keep.shape[:2]
    # weights on one 0-1 scale for every panel (a dark cell is a small weight, not small for its panel);
    # dropout's kept weights are scaled up by 1/(1-p), so the scale then reaches the largest of them
    weights = [stages.stage(name)[b, h] for name in names if name in ("weights", "unmasked") for b, h in pairs]
    top = max([1.0] + [float(w[torch.isfinite(w)].max()) for w in weights if bool(torch.isfinite(w).any())])
    weight_label = "weight (0 = none, 1 = all of it)" if not stages.dropout else (
        f"weight after dropout {stages.dropout} (kept ones scaled by 1/(1-p))")
    grid = []
    for r, (b, h) in enumerate(pairs):
        keep = stages.keep[b, h].cpu().numpy()
        prefix = f"b{b} h{h}: " if batch * heads > 1 else ""
        marks = structure(mask, b)
        values_of = {name: stages.stage(name)[b, h].detach().to("cpu", torch.float64).numpy() for name in names}
        scores = [_finite(values_of[n], keep, n in ("scores", "scaled") or stages.fill == "multiply") for n in names if n in SCORE_STAGES]
        scores = np.concatenate(scores) if scores else np.zeros(0)
        score_scale = (float(scores.min()), float(scores.max())) if scores.size and scores.min() < scores.max() else None
        row = []
        for name in names:
            values = values_of[name]
            if name == "output":
                dims = [f"d{j}" for j in range(values.shape[-1])]
                row.append(Panel(prefix + name, np.ones(values.shape, dtype=bool), row_labels, dims, values=values, x_label="dimension"))
            elif name in ("weights", "unmasked"):
                row.append(Panel(prefix + name, keep if name == "weights" else np.ones_like(keep), row_labels, col_labels, values=values,
                                 show_leaks=name == "weights", scale=(0.0, top), shared=weight_label, marks=marks))
            else:
                before = name in ("scores", "scaled") or (name == "masked" and stages.fill == "multiply")
                row.append(Panel(prefix + name, keep, row_labels, col_labels, values=values, before_mask=before,
                                 scale=score_scale, shared=f"score, b{b} h{h}#{r}" if score_scale else None, marks=marks))
        grid.append(row)
    dtype = str(stages.scores.dtype).removeprefix("torch.")
    how = f"like {stages.pipeline.name}" if stages.pipeline.name in LIKE else f"fill {stages.fill}"
    title = f"attend {mask.title} · {device} {dtype} · {how}" + (f" · dropout {stages.dropout}" if stages.dropout else "")
    return heatmap_figure(grid, title, None)
