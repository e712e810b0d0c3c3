"""`maskcli model` as rich renderables (steps x layer types, each cell the group its masks are) and as a figure
(each layer type's mask at each step side by side, per batch row, with padding and cache marks)."""

from __future__ import annotations

import numpy as np
from rich import box
from rich.table import Table
from rich.text import Text

from maskcli.hf.report import layers_text


def views(view, failures: list[str], held: list[str]) -> list:
    run = view.run
    prompt = run.prompt
    rows = ";".join(",".join(map(str, row)) for row in prompt.ids.tolist())
    from maskcli.hf.families import shapes

    out: list = [Text(f"maskcli model {run.name}: {type(run.config).__name__}, {len(run.types)} layers, "
                      f"{len(run.trace.calls)} attention calls in {len(view.groups)} groups", style="bold"),
                 Text(f"masks shaped by: {shapes(run.config)}"),
                 Text(f"ids {rows} (pad id {prompt.pad_id}, {prompt.side} padding); {len(run.steps)} steps")]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("step", overflow="fold")
    for kind in view.types:
        table.add_column(f"{kind}\n{layers_text(view.layers[kind])}", overflow="fold")
    for step, step_name in enumerate(run.steps):
        row = [Text(step_name)]
        for kind in view.types:
            found = view.cells.get((step, kind), [])
            text = Text()
            for number, cell in enumerate(found):
                group = view.groups[cell.group]
                if number:
                    text.append("\n")
                text.append(f"#{cell.group} ")
                text.append(group.expression or group.name, style="green" if group.expression else "yellow")
                text.append(f" {group.first.shape[2]}x{group.first.shape[3]}", style="dim")
                if len(found) > 1:
                    text.append(f" ({layers_text(cell.layers)})")
            row.append(text if found else Text("-"))
        table.add_row(*row)
    out.append(table)
    for number, group in enumerate(view.groups):
        first = group.first
        shape = "(" + ",".join(map(str, first.shape)) + ")"
        out.append(Text(f"#{number} {group.name} · {first.api} {shape} · {group.where}"))
        for finding in group.findings:
            out.append(Text(f"   {finding.code}: {finding.message}", style="red" if finding.code in ("sees-later", "polarity") else ""))
    if run.other:
        out.append(Text(f"{len(run.other)} attention calls outside the numbered layers (in --json): "
                        + ", ".join(sorted({call.where for call in run.other})[:4])))
    for line in run.chunk_check:
        out.append(Text(line, style="" if run.chunk_holds else "red"))
    for line in failures:
        out.append(Text(line, style="red"))
    for line in held:
        out.append(Text(line))
    return out


def model_figure(view):
    """Rows: each layer type (its first layer) for each batch row; columns: the steps. Queries sit at the end of the
    keys the cache returned (as trace names them); hatched keys are padding, the orange line the cache edge."""
    from maskcli.render.heatmaps import Panel, heatmap_figure
    from maskcli.render.structure import Structure, _runs
    from maskcli.trace.expect import found_padding

    run = view.run
    batch = run.prompt.ids.shape[0]
    grid = []
    for kind in view.types:
        first_layer = view.layers[kind][0]
        by_step = {call.step: call for call in run.calls if call.details["layer"] == first_layer}
        for b in range(batch):
            row = []
            for step, step_name in enumerate(run.steps):
                call = by_step.get(step)
                if call is None or call.stored is None or call.stored["form"] == "stats":
                    continue
                keep = np.asarray(call.keep())
                q_len, k_len = keep.shape[2:]
                padding = found_padding(keep)
                pad_keys: tuple = ()
                if padding:
                    valid = np.array([c == "1" for c in padding["ids"].split(";")[b].split(",")])
                    pad_keys = _runs(~valid, 0)
                marks = Structure(k_len - q_len, k_len, 0, k_len, pad_keys=pad_keys)
                number = next(n for n, g in enumerate(view.groups) if call in g.calls)
                title = f"{kind} · {step_name}\nbatch row {b} · #{number} {view.groups[number].expression or '?'}"
                row.append(Panel(title, keep[b, 0], [str(i) for i in range(k_len - q_len, k_len)],
                                 [str(i) for i in range(k_len)], marks=marks))
            if row:
                grid.append(row)
    title = (f"maskcli model {run.name}: each layer type's mask at each step (keys as the cache returned them, "
             "queries at their end)")
    return heatmap_figure(grid, title, ("may attend (True)", "masked (False)"))

