"""The house, drawn from the imports: layers that only look down, no circles, small modules.

    base      errors text memory positions intervals conventions files tensorfile
    kinds     kinds/*                      (each kind defined once)
    model     expression terms mask batchdata regions counting summary blockmask diff tracefile testing
    formats   formats/*                    (kernel formats: views of the model, read back by inspect)
    checks    checks/*                     (the rules that find a wrong mask; numpy, torch only inside attend's)
    engines   attention/* inspect/*        (torch; they do not import each other)
    metadata  pack/*                       (a packed batch: reads tensors as inspect does, builds masks)
              serve/*                      (a serving engine's batch metadata: builds masks, checks pages)
    sources   sources/*                    (every way a mask comes in, one module each; the registry commands ask:
                                            a packed batch's and an engine's masks too, read by pack/ and serve/)
    capture   trace/*                      (torch; names captured masks with inspect, checks them with diff)
              shard/*                      (a sequence split across context-parallel ranks; reads rank files as inspect does)
    families  hf/*                         (torch, transformers: tiny models run under trace's capture)
    render    render/*                     (rich, matplotlib)
    api       api                          (the Python face: build() from Python values, views and notebook display)
    commands  commands/*                   (typer; the only place that prints an error and exits)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "maskcli"
LAYERS = {
    "base": 0, "kinds": 1, "model": 2, "formats": 2.5, "checks": 2.8, "attention": 3, "inspect": 3, "pack": 3.1, "serve": 3.1, "sources": 3.2, "trace": 3.5, "shard": 3.5, "hf": 3.7, "render": 4, "api": 4.5, "commands": 5,
}
BASE = {"errors", "text", "memory", "positions", "intervals", "conventions", "files", "tensorfile", "__init__", "__main__"}
MODEL = {"expression", "terms", "mask", "why", "batchdata", "regions", "counting", "summary", "blockmask", "diff", "tracefile", "testing"}
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    if parts[1] == "api":
        return "api"
    if parts[1] in ("kinds", "formats", "checks", "attention", "inspect", "sources", "trace", "pack", "serve", "shard", "hf", "render", "commands"):
        return parts[1]
    return "model" if parts[1] in MODEL else "base"


def imports(path: Path) -> set[str]:
    """Every maskcli module and third-party top-level package imported anywhere in the file (lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {}
    for module, path in known.items():
        if module.endswith("__main__"):
            continue
        edges[module] = {name for name in imports(path) if name in known and name != module}
    return edges


def test_every_import_looks_down_or_sideways_within_its_package():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            if target == "maskcli":
                continue
            a, b = layer(module), layer(target)
            if LAYERS[b] > LAYERS[a] or (LAYERS[a] == LAYERS[b] and a != b):
                wrong.append(f"{module} ({a}) imports {target} ({b})")
    assert wrong == []


def test_no_circle_of_imports():
    edges = graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("heavy", ["typer", "rich", "matplotlib", "click"])
def test_the_core_knows_nothing_of_the_command_line_or_the_screen(heavy):
    for module, path in modules().items():
        if layer(module) in ("base", "kinds", "model", "checks", "attention", "inspect", "sources", "trace", "pack", "hf"):
            assert not any(name == heavy or name.startswith(heavy + ".") for name in imports(path)), module


def test_only_commands_import_typer_and_only_commands_and_render_import_rich():
    for module, path in modules().items():
        names = {name.split(".")[0] for name in imports(path)}
        if "typer" in names:
            assert layer(module) == "commands", module
        if "rich" in names:
            assert layer(module) in ("commands", "render", "api"), module


def test_torch_is_imported_at_module_level_only_where_torch_is_the_point():
    for module, path in modules().items():
        top = {alias.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.Import) for alias in node.names}
        top |= {node.module for node in ast.parse(path.read_text()).body if isinstance(node, ast.ImportFrom) and node.module}
        if "torch" in top or any(name.startswith("torch.") for name in top):
            # render.stages draws attention's tensors, and only attend imports it
            assert layer(module) in ("attention", "inspect", "trace", "hf") or module in ("maskcli.tensorfile", "maskcli.render.stages"), module


def test_transformers_is_imported_only_by_hf_and_inside_the_model_command():
    for module, path in modules().items():
        tree = ast.parse(path.read_text())
        top = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
        top |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
        anywhere = imports(path)
        if any(name.split(".")[0] == "transformers" for name in anywhere):
            assert layer(module) == "hf" or module == "maskcli.commands.model", module
        assert not any(name.split(".")[0] == "transformers" for name in top), module  # never at import time


def test_no_module_is_over_400_lines():
    long = {module: len(path.read_text().splitlines()) for module, path in modules().items()}
    assert {m: n for m, n in long.items() if n > MAX_LINES} == {}


def test_commands_declare_the_mask_options_once():
    """No command lists the kind parameters itself: they come from the registry through one decorator."""
    for path in (PACKAGE / "commands").glob("*.py"):
        if path.name == "options.py":
            continue
        text = path.read_text()
        assert '"--window"' not in text and '"--diagonal"' not in text and '"--chunks"' not in text.replace('{"--chunks": labels}', ""), path.name
