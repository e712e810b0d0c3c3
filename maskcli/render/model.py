"""`maskcli model` as rich renderables (steps x layer types, each cell the group its masks are) and as a figure
(each layer type's mask at each step side by side, per batch row, with padding and cache marks)."""

from __future__ import annotations

import numpy as np
from rich import box
from rich.table import Table
from rich.text import Text

from maskcli.hf.report import layers_text
from maskcli.render import STYLES, hanging, labelled
from maskcli.text import shortened
from maskcli.checks.registry import severity


def views(view, failures: list[str], held: list[str]) -> list:
    run = view.run
    prompt = run.prompt
    rows = ";".join(",".join(map(str, row)) for row in prompt.ids.tolist())
    from maskcli.hf.families import shapes

    out: list = [Text(f"maskcli model {run.name}: {type(run.config).__name__}, {len(run.types)} layers, "
                      f"{len(run.trace.calls)} attention calls in {len(view.groups)} groups", style="bold"),
                 hanging("masks shaped by: ", Text(shapes(run.config))),
                 hanging("ids ", Text(f"{rows} (pad id {prompt.pad_id}, {prompt.side} padding); {len(run.steps)} steps"))]
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
        sink = f" (the sink logit's column {first.details['sink_column']} left out)" if first.details.get("sink_column") else ""
        # wrapped lines stand under the text, not at column 0, at any width (60 columns break these lines)
        out.append(hanging(f"#{number} ", Text(f"{group.name} · {first.api} {shape}{sink} · {group.where}")))
        for finding in group.findings:
            out.append(hanging("   ", Text(f"{finding.code}: {finding.message}"), style=STYLES[severity(finding)]))
    if run.other:
        out.append(Text(f"{len(run.other)} attention calls outside the numbered layers (in --json): "
                        + ", ".join(sorted({call.where for call in run.other})[:4])))
    for line in run.chunk_check:
        out.append(labelled(line, "" if run.chunk_holds else "red"))
    for line in run.cache_check:
        out.append(labelled(line, "" if run.cache_holds else "red"))
    for line in failures:
        out.append(labelled(line, "red"))
    for line in held:
        out.append(labelled(line, ""))
    return out


def model_figure(view):
    """Rows: each layer type (its first layer) for each batch row; columns: the steps. Cells sit on absolute positions
    (the run's, from its cache kind); hatched keys and queries are padding, the orange line the cache edge."""
    from maskcli.render.heatmaps import heatmap_figure

    run = view.run
    batch = run.prompt.ids.shape[0]
    steps = len(run.steps)
    valid = np.concatenate([run.prompt.attention_mask.numpy().astype(bool), np.ones((batch, steps), dtype=bool)], axis=1)
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
                row.append(_panel(call, keep, b, valid[b], f"{kind} · {step_name}\nbatch row {b}", view))
            if row:
                grid.append(row)
    title = (f"maskcli model {run.name}: each layer type's first layer at each step, on absolute positions "
             "(keys where the cache's slots hold them)")
    return heatmap_figure(grid, title, ("may attend (True)", "masked (False)"))


def _panel(call, keep: np.ndarray, b: int, valid: np.ndarray, title: str, view):
    """One call's mask for batch row b, on absolute positions where the cache says where its keys sit."""
    from maskcli.render.heatmaps import Panel
    from maskcli.render.structure import Structure, _runs

    q0, q1 = call.details["queries"]
    number = next(n for n, g in enumerate(view.groups) if call in g.calls)
    group = view.groups[number]
    # no expression rebuilds it: the recogniser's words for it, as the text report names the group, not '?'
    title = f"{title} · #{number} {group.expression or shortened(group.name, 48)}"
    if call.details.get("sink_column"):  # GPT-OSS's sink logit, the softmax's last column, cut as it was recorded
        title += " (sink column left out)"
    if "keys" in call.details:
        k0, k1 = call.details["keys"]
        valid = np.concatenate([valid, np.ones(max(0, k1 - len(valid)), dtype=bool)])  # static slots not yet filled
        marks = Structure(q0, q1, k0, k1, pad_keys=_runs(~valid[k0:k1], k0), pad_queries=_runs(~valid[q0:q1], q0),
                          edge_by="the model's KV cache")
        keys = [str(i) for i in range(k0, k1)]
    else:  # slots of a ring, not in position order: each slot named by the position it holds, no marks drawn
        marks = None
        keys = [f"{p}" if p >= 0 else "-" for p in call.details["slots"]]
    return Panel(title, keep[b, 0], [str(i) for i in range(q0, q1)], keys, marks=marks,
                 x_label="key position (kv)" if marks is not None else "key position each cache slot holds, in slot order")
