"""The docs site: every documented output is what the command prints now, the reference is the help,
every command and kind is documented, and every figure's command runs and its image is there."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)

PAGES = generate.pages()
BLOCKS = [(page.name, command, output) for page in PAGES for command, output in generate.console_blocks(page.read_text())]
FIGURES = [(page.name, command) for page in PAGES for command in generate.figures(page.read_text())]


def test_the_site_has_its_pages_and_enough_examples():
    assert {page.name for page in PAGES} >= {"index.md", "tutorial.md", "gallery.md", "pitfalls.md", "reference.md", "python.md"}
    assert len(BLOCKS) >= 20 and len(FIGURES) >= 20


def needs_transformers(command: str) -> bool:
    """model, a family's config (--model), or a traced program that imports transformers."""
    words = shlex.split(command)
    programs = [ROOT / word for word in words if word.endswith(".py") and (ROOT / word).exists()]
    return (words[1] == "model" or "--model" in words
            or any("transformers" in program.read_text() for program in programs))


@pytest.mark.parametrize("page, command, documented", BLOCKS, ids=[f"{p}: {c[:60]}" for p, c, _ in BLOCKS])
def test_every_documented_output_is_what_the_command_prints(page, command, documented):
    if needs_transformers(command):
        pytest.importorskip("transformers", reason="this output needs the hf extra (transformers)")
    code, output = generate.run(command)
    assert code in (0, 1), output
    assert output.rstrip("\n") == documented.rstrip("\n"), f"{page} is out of date: run python docs/generate.py"


def test_the_reference_is_every_commands_help():
    text = (ROOT / "docs" / "reference.md").read_text()
    documented = re.findall(r"<!-- help: (\w+) -->", text)
    assert sorted(documented) == sorted(generate.COMMANDS)
    assert generate.refreshed_reference(text) == text, "docs/reference.md is out of date: run python docs/generate.py"


def test_the_reference_lists_every_option_help_leaves_out():
    import typer.main

    from maskcli.commands import app

    text = (ROOT / "docs" / "reference.md").read_text()
    for name, command in typer.main.get_command(app).commands.items():
        section = text.split(f"<!-- help: {name} -->")[1].split("<!-- help:")[0]
        for param in command.params:
            if not param.hidden:  # (the kind-parameter flags are hidden, and listed by maskcli kinds)
                for opt in (o for o in param.opts if o.startswith("-")):
                    assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", section), (name, opt)


def test_every_command_and_kind_is_documented():
    from maskcli.commands import app
    from maskcli.kinds import names

    import typer.main

    commands = set(typer.main.get_command(app).commands)
    assert commands == set(generate.COMMANDS)
    gallery = (ROOT / "docs" / "gallery.md").read_text()
    headings = " ".join(re.findall(r"^### (.+)$", gallery, re.M))
    for kind in names():
        assert kind in headings, f"kind {kind!r} has no section in docs/gallery.md"


@pytest.mark.parametrize("page, command", FIGURES, ids=[f"{p}: {c[:60]}" for p, c in FIGURES])
def test_every_figure_is_drawn_by_its_command(page, command, tmp_path):
    args = shlex.split(command)
    target = args[args.index("--png") + 1]
    assert (ROOT / target).is_file(), f"{target} is missing: run python docs/generate.py"
    text = (ROOT / "docs" / page).read_text()
    assert f"]({Path(target).relative_to('docs').as_posix()})" in text
    shown = generate.figure_command(command)  # its command as text under the image, the folder left out
    assert f"]({Path(target).relative_to('docs').as_posix()})\n\n`{shown}`\n" in text and "docs/img" not in shown
    args[args.index("--png") + 1] = str(tmp_path / Path(target).name)
    code, output = generate.run(shlex.join(args))
    assert code in ((0, 1) if args[1] == "pack" else (0,)), output  # pack's 1: what the figure shows leaks
    assert (tmp_path / Path(target).name).stat().st_size > 1000


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed")
def test_the_site_builds_strict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_packed_batches_the_docs_check_are_current():
    assert generate.stale_batches(write=False) == [], "docs/batches is out of date: run python docs/generate.py"
