"""The run in one view: for each step and layer type, the groups (as `trace` groups and names them) its layers' masks are."""

from __future__ import annotations

from dataclasses import dataclass

from maskcli.text import spans


@dataclass
class Cell:
    group: int  # the group's number
    layers: list[int]  # the layers of this type whose call at this step is in the group


@dataclass
class View:
    run: object  # ModelRun
    groups: list  # maskcli.trace.report.Group
    types: list[str]  # the layer types, in the order of their first layer
    layers: dict  # type -> its layers
    cells: dict  # (step, type) -> [Cell]

    def name(self, number: int) -> str:
        return self.groups[number].name

    def json(self, failures: list[str]) -> dict:
        numbers = self._numbers()
        run = self.run
        return {"family": run.name, "config": {"class": type(run.config).__name__, **shaping(run.config)},
                "layer_types": run.types, "steps": run.steps, "ids": run.prompt.ids.tolist(), "pad_id": run.prompt.pad_id,
                "generated": run.generated,
                "table": [{"step": run.steps[step] if step < len(run.steps) else step, "layer_type": kind,
                           "cells": [{"group": cell.group, "layers": cell.layers, "name": self.name(cell.group)} for cell in found]}
                          for (step, kind), found in self.cells.items()],
                "calls": [{**call.json(), "group": numbers[call.index]} for call in run.calls],
                "groups": [group.json() for group in self.groups],
                "other_calls": [call.json() for call in run.other], "expect": failures,
                "prefill_chunks": {"lines": run.chunk_check, "holds": run.chunk_holds},
                "cache": {"lines": run.cache_check, "holds": run.cache_holds, "first": run.cache_first}, "timings": run.timings}

    def _numbers(self) -> dict:
        return {call.index: number for number, group in enumerate(self.groups) for call in group.calls}


def shaping(config) -> dict:
    from maskcli.hf.families import SHAPERS

    return {name: getattr(config, name) for name in (*SHAPERS, "layer_types", "pad_token_id") if getattr(config, name, None) is not None}


def view(run) -> View:
    from maskcli.checks.context import Run
    from maskcli.checks.engine import apply
    from maskcli.trace.report import group

    checked = Run(run.calls, getattr(run.trace, "tops", []))
    groups = apply(group(run.calls, run=checked), checked)
    numbers = {call.index: number for number, g in enumerate(groups) for call in g.calls}
    types = list(dict.fromkeys(run.types))
    layers = {kind: [i for i, t in enumerate(run.types) if t == kind] for kind in types}
    cells: dict = {}
    for call in run.calls:
        found = cells.setdefault((call.step, call.details["layer_type"]), [])
        number = numbers[call.index]
        for cell in found:
            if cell.group == number:
                cell.layers.append(call.details["layer"])
                break
        else:
            found.append(Cell(number, [call.details["layer"]]))
    ordered = dict(sorted(cells.items(), key=lambda item: (item[0][0], types.index(item[0][1]))))
    return View(run, groups, types, layers, ordered)


def layers_text(layers: list[int]) -> str:
    return ("layer " if len(layers) == 1 else "layers ") + spans(layers)
