"""`maskcli kinds`: every kind in the registry, as a readable list and as JSON."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.commands.kinds import example_command
from maskcli.kinds import all_kinds

runner = CliRunner()


def ok(args, **kwargs):
    result = runner.invoke(app, args, **kwargs)
    assert result.exit_code == 0, result.output
    return result


def test_json_lists_every_kind_with_its_parameters():
    data = json.loads(ok(["kinds", "--json"]).stdout)
    assert [k["name"] for k in data] == [kind.name for kind in all_kinds()]
    assert {k["name"] for k in data} == {
        "full", "causal", "tril", "triu", "window", "lookback", "band", "prefix", "sink", "local", "chunk", "document", "segment", "blocks", "tree", "padding",
    }
    window = next(k for k in data if k["name"] == "window")
    assert window == {
        "name": "window", "signature": "window(W)",
        "meaning": "sliding window: each query sees itself and the W-1 keys before it (Mistral, Gemma; W keys as Hugging Face counts)",
        "keep": "q - W < kv <= q",
        "params": [{"name": "window", "type": "int", "flag": "--window", "required": True, "default": None, "minimum": 1,
                    "choices": None, "sizes": False,
                    "help": "keys each query sees: itself and the W-1 before it (Hugging Face's count; FlashAttention window_size=(W-1, 0))"}],
        "example": "window(3)", "command": 'maskcli show "window(3)"', "aliases": [], "causal": True,
    }
    tril = next(k for k in data if k["name"] == "tril")
    assert [(p["name"], p["default"], p["choices"]) for p in tril["params"]] == [("diagonal", 0, None), ("means", "keep", ["keep", "block"])]
    assert next(k for k in data if k["name"] == "causal")["aliases"] == ["prefill"]
    assert next(k for k in data if k["name"] == "full")["aliases"] == ["bidirectional"]


@pytest.mark.parametrize("kind", [k.name for k in all_kinds()])
def test_every_example_command_runs(kind):
    command = next(k for k in json.loads(ok(["kinds", "--json"]).stdout) if k["name"] == kind)["command"]
    args = shlex.split(command)
    assert args[:2] == ["maskcli", "show"]
    result = ok(args[1:], env={"COLUMNS": "120"})
    assert result.stdout.startswith(json.loads(ok([*args[1:], "--json"]).stdout)["expression"])


def test_the_list_reads_at_60_columns():
    text = ok(["kinds"], env={"COLUMNS": "60"}).stdout
    assert all(len(line) <= 60 for line in text.splitlines())
    for kind in all_kinds():
        assert kind.signature in text
    flat = " ".join(text.split())
    assert "window(W) keeps q - W < kv <= q" in flat and "W --window keys each query sees: itself and the W-1 before it" in flat
    assert "also: prefill" in flat and "also: bidirectional" in flat and "a document label per position; or sizes=[3,5] / --sizes 3,5" in flat
    assert 'example: maskcli show "causal | blocks(-1,-1,0,0,0,-1)"' in flat


def test_aliases_build_their_kind_and_help_names_them():
    bidirectional = ok(["show", "bidirectional", "--len", "3", "--json"]).stdout
    assert json.loads(bidirectional)["expression"] == "full"
    assert json.loads(bidirectional)["mask"] == [[[[True] * 3] * 3]]  # every query sees every key
    flat = " ".join(ok(["show", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "Kinds: full (or bidirectional), causal (or prefill), window(W)," in flat


def test_at_60_columns_wrapped_lines_stand_in_and_examples_stay_whole():
    """A wrapped head went back to column 0, where it read as the next kind ('start' alone under local's head); a
    parameter's wrapped help stood under the parameter names; and examples broke inside their quoted expression
    ('maskcli show "document(0,0,0,0,0,1,1,1) &' / 'local(2)"'), so that they did not copy as one command."""
    text = ok(["kinds"], env={"COLUMNS": "60"}).stdout
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines)
    heads = [line for line in lines if line and not line.startswith(" ")]
    assert [head.split()[0] for head in heads] == [kind.signature.split()[0] for kind in all_kinds()]
    at = lines.index("local(C, documents=LABELS)   keeps kv <= q, in q's chunk: C")
    assert lines[at + 1:at + 3] == ["    positions from the row's first real token or the", "    document's start"]
    assert "  W --window  keys each query sees: itself and the W-1" in lines
    assert "    before it (Hugging Face's count; FlashAttention" in lines
    for kind in all_kinds():
        command = example_command(kind)
        assert f"  example: {command}" in lines or lines[lines.index(f"  {command}") - 1] == "  example:"
    assert lines[lines.index('  maskcli show "document(0,0,0,0,0,1,1,1) & local(2)"') - 1] == "  example:"
    wide = ok(["kinds"], env={"COLUMNS": "120"}).stdout.splitlines()
    assert '  example: maskcli show "document(0,0,0,0,0,1,1,1) & local(2)"' in wide
