"""A property fuzz over every command: command lines drawn from each command's real options, valid and not.

Whatever the line, maskcli ends with exit status 0, 2, or 1 where the command documents it (diff when the
masks differ, verify --strict), never an uncaught exception, and leaves no file but the outputs it was
asked for (and those only on success). MASKCLI_FUZZ_EXAMPLES sets the examples per command (default 12).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import typer.main
from hostile_files import LONG, plant
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from maskcli.commands import app

EXAMPLES = int(os.environ.get("MASKCLI_FUZZ_EXAMPLES", "12"))
COMMANDS = typer.main.get_command(app).commands
runner = CliRunner()

INTS = [-(2**63) - 1, -3, -1, 0, 1, 2, 3, 4, 5, 8, 2**31, 2**63, 10**30, "x", "1.5", "", "0x10"]
FLOATS = [0, 0.1, 0.5, 1, 1.5, -1, "nan", "inf", "-inf", "abc", "1e308", ""]
EXPRESSIONS = [
    "causal", "full", "window(3)", "prefix(2)", "sink(1)", "local(2)", "tril(-1)", "triu(1)", "padding", "prefill",
    "chunk(0,0,1,1)", "document(0,0,1,1)", "segment(0,1,1,1)", "blocks(-1,0,0,-1)", "tree(-1,0,0,1)",
    "document(sizes=[2,2])", "causal & window(2)", "causal | blocks(-1,0,0,-1)", "~triu(1)", "causal & (window(2) | sink(1))",
    "window", "chunk", "document", "tril", "mine & causal",
    "causal &", "window(3", "causl", "window(x)", "((", "~", "window(-1)", "chunk(0,x)", "document(sizes=[])",
    'document("good.npy")', 'document("missing.npy")', "a" * 300, "", "causal & & causal", "tree(5)", "blocks(0;1)",
]
FILES = ["good.pt", "good.npy", "missing.pt", "meta.pt", "evil.pt", "pickle.pt", "negative.safetensors",
         "beyond.safetensors", "deep.json", "bad.json", "empty.npy", "dir.pt", "loop.pt", "fifo.pt", "/dev/zero",
         LONG + ".pt", "q.pt", "[[1,0],[1,1]]", "[[true]]", "[]", "nan"]
OUTPUTS = ["out.png", "out.svg", "out.pdf", "out.npy", "out.NPY", "out.pt", "out.json", "out.gif", "out.npz", "out.safetensors", "", "missing/out.png",
           "dir.pt", "good.npy/x.png", LONG + ".png", "fifo.pt", "."]
LABELS = ["0,0,1,1", "0,1;1,1", "1,x", ",", ";", "", "3,2", "0", "-1,-1", "4,2", "5,6,7,0;0,8,9,1", "1,2;3", "0,10**30"]
WORDS = {
    "--align": ["top-left", "bottom-right", "middle", ""],
    "--as": ["keep", "block", "additive", "min", "int", "sideways"],
    "--to": ["keep", "block", "additive", "min", "int", "sideways"],
    "--from": ["keep", "block", "int", "sideways", "flash-attn", "cu_seqlens", "flashmask", "magi", "flex"],
    "--for": ["sdpa", "mha", "hf", "flex", "flash-attn", "flashinfer", "flashmask", "magi", "xformers", "cudnn", ""],
    "--dtype": ["float32", "float16", "bfloat16", "float64", "bogus"],
    "--means": ["keep", "block", "sideways"],
    "--fill": ["-inf", "min", "-1e9", "multiply", "zero"],
    "--device": ["cpu", "auto", "tpu", "cuda:99", ""],
    "--stages": ["scores,weights", "weights", ",,", "nothing"],
    "--block": ["16", "128", "16,32", "0", "x", "1,2,3", str(10**30)],
    "--grid": ["4,8", "0,0", "x", "5000,5000"],
    "--tokens": ["a b c d", "one", "", "a b c d e f g h"],
    "--key": ["mask", "missing", ""],
    "--mask-mod": ["mod.py:factory", "mod.py:raises", "mod.py:floats", "mod.py:shape", "mod.py:nothing", "syntax.py:broken",
                   "missing.py:f", "os:system", "nomodule"],
    "--mask-mod-args": ["2", "__import__('os')", "(", "2, 3"],
    "--attn": ["sdpa", "eager", "flash", ""],
    "--cache": ["dynamic", "static", "sliding", "paged"],
    "--pad": ["left", "right", "middle"],
    "--expect": ["*=causal", "full_attention=window(2)", "x", "=causal", "a=window("],
    "--mask": FILES,
    "--q": FILES, "--k": FILES, "--v": FILES, "--x": FILES + ["[[1,2],[3,4],[5,6],[7,8]]"],
}


def option_values(option) -> st.SearchStrategy:
    opt = max(option.opts, key=len)
    annotation = _annotation(option)
    if opt in WORDS:
        pool = WORDS[opt]
    elif opt in ("--png", "--save", "--out"):
        pool = OUTPUTS
    elif opt in ("--lengths", "--ids", "--chunks", "--sizes", "--block-ids", "--parents"):
        pool = LABELS
    elif annotation is int:
        pool = INTS
    elif annotation is float:
        pool = FLOATS
    else:
        pool = LABELS + FILES
    return st.one_of(st.sampled_from(pool), st.text(max_size=6)).map(str)


def _annotation(option) -> type:
    """The Python type an option takes, from typer's descriptor (0.29+) or click's parameter type."""
    descriptor = getattr(option, "type_descriptor", None)
    if descriptor is not None:
        return getattr(descriptor, "annotation", str)
    kind = getattr(getattr(option, "type", None), "name", "")
    return {"integer": int, "float": float}.get(kind, str)


def positionals(name: str) -> st.SearchStrategy:
    if name in ("show", "attend", "verify", "blocks", "export"):
        return st.lists(st.sampled_from(EXPRESSIONS), max_size=1)
    if name == "chunk":
        return st.lists(st.sampled_from(LABELS), max_size=1)
    if name == "diff":
        return st.lists(st.sampled_from(EXPRESSIONS + FILES), max_size=2)
    if name in ("inspect", "convert", "pack"):
        return st.lists(st.sampled_from(FILES), max_size=1)
    if name == "model":  # a family runs only where transformers is installed; the rest is refused either way
        return st.lists(st.sampled_from(["llama", "mistral", "lama", "bad.json", "missing.json", "good.npy", ""]), max_size=1)
    return st.just([])


@st.composite
def command_lines(draw, name: str) -> list[str]:
    command = COMMANDS[name]
    options = [p for p in command.params if p.param_type_name == "option" and "--help" not in p.opts]
    chosen = draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda p: p.name)) if options else []
    line = [name, *draw(positionals(name))]
    for option in chosen:
        opt = draw(st.sampled_from(option.opts))
        if option.is_flag:
            line.append(opt)
        else:
            line += [opt, draw(option_values(option))]
    return line


def outputs_named(line: list[str]) -> set[str]:
    """The files the line asks for: --save/--png/--out values (a folder gets a default name inside)."""
    return {line[i + 1] for i, arg in enumerate(line[:-1]) if arg in ("--save", "--png", "--out")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    place = tmp_path_factory.mktemp("fuzz")
    plant(place)
    return place


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_any_command_line_ends_cleanly(folder, name):
    documented_one = {"diff": lambda line: True, "pack": lambda line: True,  # pack: 1 = paths disagree or a finding
                      "verify": lambda line: "--strict" in line,
                      "model": lambda line: "--expect" in line or "--prefill-chunk" in line or "right" in line or "--ids" in line,
                      }.get(name, lambda line: False)  # (model: right padding or pads in --ids, a decode continued from a pad)
    planted = {p.relative_to(folder) for p in folder.rglob("*")}
    cwd = Path.cwd()

    @settings(max_examples=EXAMPLES, deadline=30_000, derandomize=os.environ.get("CI") == "true",
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(line=command_lines(name))
    def run(line):
        os.chdir(folder)
        try:
            result = runner.invoke(app, line, env={"MASKCLI_DEVICE": "cpu", "COLUMNS": "80"})
        finally:
            os.chdir(cwd)
        assert result.exception is None or isinstance(result.exception, SystemExit), (line, repr(result.exception))
        assert "Traceback" not in result.output, (line, result.output)
        allowed = {0, 2} | ({1} if documented_one(line) else set())
        assert result.exit_code in allowed, (line, result.exit_code, result.output)
        if result.exit_code == 2:
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("maskcli: error: "), (line, result.stderr)
        made = {p.relative_to(folder) for p in folder.rglob("*")} - planted
        for path in made:  # clean up for the next example, after looking
            (folder / path).unlink() if (folder / path).is_file() else None
        stray = {p for p in made if p.name.startswith(".")}
        assert not stray, (line, stray)
        if result.exit_code != 0:
            assert not made, (line, made)
        else:
            named = outputs_named(line)
            assert all(str(p) in named or str(p.parent) in named for p in made), (line, made, named)

    run()


# --- cross-checks: the counts of --summary --json and blocks --json against the full mask of the same line -------

ANY_LENGTH = ["causal", "full", "window(3)", "prefix(2)", "sink(1)", "local(3)", "tril(-1)", "triu(1)", "causal & window(2)",
              "causal | sink(2)", "~causal", "causal & ~sink(1)", "window(2) | prefix(3)"]


@st.composite
def placed_masks(draw) -> list[str]:
    """An expression with its positions, heads and padding, as a command line's tail."""
    length = draw(st.integers(1, 24))
    labels = ",".join(str(v) for v in draw(st.lists(st.integers(-1, 3), min_size=length, max_size=length)))
    labelled = [f"document({labels.replace('-1', '0')})", f"chunk({labels.replace('-1', '0')})", f"blocks({labels})",
                f"causal | blocks({labels})", f"segment({labels.replace('-1', '2')}) & window(4)"]
    line = [draw(st.sampled_from(ANY_LENGTH + labelled)), "--len", str(length), "--heads", str(draw(st.integers(1, 3)))]
    if draw(st.booleans()):
        line += ["--lengths", ",".join(str(draw(st.integers(0, length))) for _ in range(draw(st.integers(1, 3))))]
    if draw(st.booleans()):
        line += ["--offset", str(draw(st.integers(0, 6)))]
    return line


def _json(args):
    result = runner.invoke(app, args, env={"MASKCLI_DEVICE": "cpu"})
    assume(result.exit_code != 2 or args[0] != "show" or "--summary" in args)  # a line refused as a whole (prefix(3) at 1 token)
    assert result.exit_code == 0, (args, result.output)
    return json.loads(result.stdout)


@settings(max_examples=max(EXAMPLES, 20), deadline=None, derandomize=os.environ.get("CI") == "true",
          suppress_health_check=[HealthCheck.too_slow])
@given(line=placed_masks(), grid=st.tuples(st.integers(1, 5), st.integers(1, 5)), block=st.integers(1, 9))
def test_summary_and_blocks_json_count_what_the_full_mask_holds(line, grid, block):
    cells = np.array(_json(["show", *line, "--json"])["mask"], dtype=bool)  # (B, H, Lq, Lk): every head
    batch, heads, q_len, k_len = cells.shape
    summary = _json(["show", *line, "--summary", "--json", "--grid", f"{grid[0]},{grid[1]}"])
    assert summary["visible_cells"] == cells.sum() and summary["total_cells"] == cells.size
    rb, cb = -(-q_len // grid[0]), -(-k_len // grid[1])
    for b, row in enumerate(summary["batch_rows"]):
        keys = cells[b].sum(-1)  # (H, Lq)
        assert (row["visible_cells"], row["total_cells"]) == (cells[b].sum(), cells[b].size)
        assert row["row_keys"] == {"min": keys.min(), "median": float(np.median(keys)), "max": keys.max()}
        assert row["empty_rows"] == (keys == 0).sum()
        per_block = np.add.reduceat(np.add.reduceat(cells[b].sum(0), np.arange(0, q_len, rb), 0), np.arange(0, k_len, cb), 1)
        assert np.array_equal(np.array(summary["grid"]["visible"][b]), per_block)
    found = _json(["blocks", *line, "--block", str(block), "--json"])
    n_q, n_kv = -(-q_len // block), -(-k_len // block)
    padded = np.zeros((batch, heads, n_q * block, n_kv * block), dtype=bool)  # create_block_mask pads with hidden cells
    padded[:, :, :q_len, :k_len] = cells
    per = padded.reshape(batch, heads, n_q, block, n_kv, block).sum(axis=(3, 5))
    full, partial = per == block * block, (per > 0) & (per < block * block)
    assert np.array_equal(np.array(found["full_kv_num_blocks"]), full.sum(-1))
    assert np.array_equal(np.array(found["kv_num_blocks"]), partial.sum(-1))
    for name, chosen in (("kv_indices", partial), ("full_kv_indices", full)):
        indices = np.array(found[name])
        for b, h, qb in np.ndindex(batch, heads, n_q):
            assert list(indices[b, h, qb, : chosen[b, h, qb].sum()]) == list(np.flatnonzero(chosen[b, h, qb]))
    for entry in found["counts"]:
        b, h = entry["batch"], entry["head"]
        assert (entry["full"], entry["partial"]) == (full[b, h].sum(), partial[b, h].sum())
