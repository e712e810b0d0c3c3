"""`maskcli trace`: programs written here run as python runs them; their masks are checked against references
computed here (a double loop, torch.tril), grouped, named, saved, read back and checked with --expect."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()

LAYERS = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F


def window(length, width):
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    return (k <= q) & (q - k < width)


class Attention(nn.Module):
    def forward(self, x, mask):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()

    def forward(self, x, mask):
        return self.self_attn(x, mask)


class Model(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x, length, width, odd):
        shared = window(length, width)
        for number, layer in enumerate(self.layers):
            x = layer(x, window(length, width + 1) if number == odd else shared)
        return x
"""


def write(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def trace(*args, **kwargs):
    return runner.invoke(app, ["trace", *map(str, args)], **kwargs)


def window_reference(q_len: int, k_len: int, width: int) -> list:
    """Queries at the end of the keys, each seeing itself and width - 1 keys before it: a double loop."""
    return [[int(k_len - q_len + i - width < k <= k_len - q_len + i) for k in range(k_len)] for i in range(q_len)]


@pytest.fixture
def layers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return write(tmp_path, "layers.py", LAYERS + """
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--len", type=int, default=5)
parser.add_argument("--window", type=int, default=2)
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--odd", type=int, default=3)
parser.add_argument("-x", action="store_true")
args = parser.parse_args()
out = Model(args.layers)(torch.randn(1, 2, args.len, 4), args.len, args.window, args.odd)
print("len", args.len, "x", args.x, "shape", list(out.shape))
""")


def test_arguments_after_the_script_are_the_programs_and_its_stdout_is_untouched(layers):
    result = trace(layers, "--len", "3", "-x")
    assert result.exit_code == 0, result.output
    assert result.stdout == "len 3 x True shape [1, 2, 3, 4]\n"
    assert "6 attention calls in 2 groups" in result.stderr


def test_masks_repeated_across_layers_form_one_row_named_by_the_recogniser(layers):
    result = trace(layers, "--len", "5", "--window", "2", env={"COLUMNS": "120"})
    rows = [line.split() for line in result.stderr.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [
        ["0", "layers.{0-2,4-5}.self_attn", "×5", "sdpa", "prefill", "(1,2,5,5)", "window(2)"],
        ["1", "layers.3.self_attn", "sdpa", "prefill", "(1,2,5,5)", "window(3)"],
    ]


def test_json_gives_every_call_and_save_reads_back_as_a_mask(layers, tmp_path):
    result = trace("--json", "t.json", "--save", "t.pt", layers, "--len", "5", "--window", "3")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "t.json").read_text())
    assert [call["where"] for call in data["calls"]] == [f"layers.{i}.self_attn" for i in range(6)]
    assert [call["group"] for call in data["calls"]] == [0, 0, 0, 1, 0, 0]
    assert all(call["shape"] == [1, 2, 5, 5] and call["api"] == "sdpa" and call["dtype"] == "float32" for call in data["calls"])
    assert data["groups"][1]["expression"] == "window(4)" and data["exit_status"] == 0
    for spec, width in (("t.pt:3", 4), ("t.pt:layers.5.self_attn@0", 3)):
        shown = runner.invoke(app, ["show", "--mask", spec, "--json"])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["mask"][0][0] == window_reference(5, 5, width)
    diff = runner.invoke(app, ["diff", "t.pt:0", "window(3)"])
    assert diff.exit_code == 0, diff.output
    for cell, kept in (("4,1", "kept"), ("4,0", "masked")):  # a traced call is a tensor: its cell, and why no tree
        why = runner.invoke(app, ["show", "--mask", "t.pt:3", "--why", cell])
        assert why.stdout.startswith(f"query 4, key {cell[-1]} of t.pt:3") and f": {kept}\n  the cell of t.pt:3" in why.stdout, why.output
    why = runner.invoke(app, ["diff", "t.pt:3", "window(3)", "--why", "4,1"])
    assert why.exit_code == 1 and "A keeps it, B masks it" in why.stdout and "window(3): 4 - 1 = 3 >= 3 -> masked" in why.stdout
    bad = runner.invoke(app, ["show", "--mask", "t.pt:layers.9.self_attn@0"])
    assert bad.exit_code == 2 and "no call of 'layers.9.self_attn' at step 0" in bad.stderr


def test_expect_holds_with_exit_0_and_fails_with_exit_1_naming_the_first_differing_cells(layers):
    good = trace("--expect", "layers.[0-2].self_attn=window(2)", "--expect", "*=causal & window(3)", layers, "--odd", "9")
    assert good.exit_code == 1  # every layer is window(2), not window(3)
    assert "--expect *=causal & window(3): call 0 (layers.0.self_attn prefill, sdpa) differs from causal & window(3): " \
           "row 2: the call sees 1-2, causal & window(3) sees 0-2: the call hides key 0" in " ".join(good.stderr.split())
    assert "--expect *=causal & window(3): 5 more calls differ: 1-5" in " ".join(good.stderr.split())
    assert "layers.[0-2]" not in good.stderr
    two = trace("--expect", "layers.[0-1].self_attn=causal & window(3)", layers, "--odd", "9")
    assert two.exit_code == 1 and "1 more call differs: 1" in " ".join(two.stderr.split())
    held = trace("--expect", "layers.*.self_attn=window(2)", layers, "--odd", "9")
    assert held.exit_code == 0 and "every call matched holds" in held.stderr
    odd = trace("--expect", "layers.*.self_attn=window(2)", layers)
    assert odd.exit_code == 1 and odd.stderr.count("differs from window(2)") == 1 and "call 3 (layers.3.self_attn" in odd.stderr
    none = trace("--expect", "decoder.*=causal", layers)
    assert none.exit_code == 1 and "no call matches 'decoder.*'" in none.stderr


def test_a_bad_expect_or_api_is_one_line_and_the_program_does_not_run(layers):
    for args, message in ((["--expect", "layers.*"], "give PATTERN=EXPR"), (["--expect", "x=window("], "--expect 'x=window('"),
                          (["--expect", "*=windo(3)"], "--expect '*=windo(3)': unknown mask kind 'windo' in 'windo(3)': did you mean window?"),
                          (["--expect", "*=causal", "--expect", "x=windo(3)"], "--expect 'x=windo(3)': unknown mask kind 'windo'"),
                          (["--expect", "*=window(0)"], "--expect '*=window(0)': window(0): window must be at least 1"),
                          (["--expect", "*=window"], "--expect '*=window': window needs --window W"),
                          (["--api", "sdpa,flashy"], "choose from sdpa, flex, mha, softmax, flash, hf, vllm")):
        result = trace(*args, layers)
        assert result.exit_code == 2 and result.stdout == "" and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("ending, status, stderr", [
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("sys.exit(3)", 3, ""),
    ("sys.exit('bye')", 1, "bye"),
    ("sys.exit(0)", 0, ""),
])
def test_the_programs_exit_status_is_kept_and_the_trace_up_to_it_reported(tmp_path, monkeypatch, ending, status, stderr):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "ends.py", f"""
        import sys
        import torch
        import torch.nn.functional as F
        q = torch.randn(1, 1, 3, 4)
        print("before")
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        {ending}
        print("never")
    """)
    result = trace(script)
    assert result.exit_code == status and result.stdout == "before\n"
    assert stderr in result.stderr and "1 attention call in 1 group" in result.stderr
    if status == 1 and "raise" in ending:
        assert result.stderr.startswith("Traceback (most recent call last):\n  File ") and "runpy" not in result.stderr
        assert "maskcli" not in result.stderr.split("ValueError: boom")[0]


def test_a_module_runs_with_m_and_its_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "tiny_mod.py", LAYERS + """
print(sys.argv[1:], __name__)
Model(2)(torch.randn(1, 1, 4, 4), 4, 2, 5)
""")
    result = trace("-m", "tiny_mod", "a", "--b")
    assert result.exit_code == 0, result.output
    assert result.stdout == "['a', '--b'] __main__\n" and "2 attention calls in 1 group" in result.stderr
    missing = trace("-m", "no_such_module_here")
    assert missing.exit_code == 2 and "no such module" in missing.stderr


def test_json_or_save_given_the_script_says_they_take_a_file_name(layers):
    for flag, suffix in (("--json", "json"), ("--save", "pt")):
        result = trace(flag, layers)
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr == f"maskcli: error: {flag} takes a file name: maskcli trace {flag} run.{suffix} {layers}\n"


def test_api_flash_or_hf_named_for_a_program_that_never_imports_them_says_so(tmp_path, monkeypatch):
    import sys

    monkeypatch.chdir(tmp_path)
    for name in [name for name in sys.modules if name == "flash_attn" or name.startswith(("flash_attn.", "transformers"))]:
        monkeypatch.setitem(sys.modules, name, None)  # (this process may hold them: as if never imported)
    script = write(tmp_path, "plain.py", """
        import torch
        import torch.nn.functional as F
        x = torch.randn(1, 1, 3, 4)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        print("ran")
    """)
    result = trace("--api", "flash,hf,sdpa", "--json", "run.json", script, env={"COLUMNS": "200"})
    assert result.exit_code == 0 and result.stdout == "ran\n", result.output
    lines = ["--api flash: the program never imported flash_attn, so --api flash recorded nothing",
             "--api hf: the program never imported transformers, so --api hf recorded nothing"]
    assert all(line in result.stderr.splitlines() for line in lines), result.stderr
    assert json.loads((tmp_path / "run.json").read_text())["not_imported"] == lines
    default = trace(script, env={"COLUMNS": "200"})  # every API by default: no word on those the program does not use
    assert default.exit_code == 0 and "never imported" not in default.stderr


def test_mha_and_softmax_and_api_picks_which(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "both.py", """
        import torch
        import torch.nn as nn
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(4, 1, batch_first=True)
        x = torch.randn(2, 3, 4)
        mha(x, x, x, key_padding_mask=torch.tensor([[False, False, False], [False, True, True]]))
        scores = torch.randn(1, 3, 3).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
        scores[0, 0, 0] = float("-inf")
        scores.softmax(-1)
    """)
    result = trace("--json", "all.json", script, env={"COLUMNS": "120"})
    data = json.loads((tmp_path / "all.json").read_text())
    assert [c["api"] for c in data["calls"]] == ["mha", "softmax"] and data["calls"][0]["where"] == "MultiheadAttention"
    assert data["groups"][0]["name"] == "padding (--lengths 3,1)"
    assert "query row 0 sees no key at all: NaN weights there (softmax of all -inf)" in " ".join(result.stderr.split())
    only = trace("--api", "mha", "--json", "mha.json", script)
    assert only.exit_code == 0 and [c["api"] for c in json.loads((tmp_path / "mha.json").read_text())["calls"]] == ["mha"]


def test_is_causal_with_fewer_queries_than_keys_is_named_top_left_with_a_finding(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "cache.py", """
        import torch
        import torch.nn.functional as F
        F.scaled_dot_product_attention(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), is_causal=True)
    """)
    result = trace("--save", "c.pt", script, env={"COLUMNS": "120"})
    text = " ".join(result.stderr.split())
    assert "causal (--kv-len 5)" in text and "top-left-causal: is_causal with 2 queries and 5 keys is aligned top-left" in text
    shown = runner.invoke(app, ["show", "--mask", "c.pt:0", "--json"])
    assert json.loads(shown.stdout)["mask"][0][0] == np.tril(np.ones((2, 5), dtype=int)).tolist()


def test_a_one_query_is_causal_call_is_named_top_left_not_a_decode_step_with_padding(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "step.py", """
        import torch
        import torch.nn.functional as F
        F.scaled_dot_product_attention(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), is_causal=True)
    """)
    result = trace("--save", "s.pt", script, env={"COLUMNS": "200"})
    text = " ".join(result.stderr.split())
    assert "causal (--kv-len 5)" in text and "lengths 1" not in text
    assert ("top-left-causal: is_causal with 1 query and 5 keys is aligned top-left: its one query sees key 0 only, so the "
            "last 4 keys are seen by no query; a decoder with a cache means bottom-right (causal --offset 4)") in text
    import torch
    import torch.nn.functional as F

    q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)  # what SDPA's is_causal keeps
    keep = torch.tensor([[[[True, False, False, False, False]]]])
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    shown = runner.invoke(app, ["show", "--mask", "s.pt:0", "--json"])
    assert json.loads(shown.stdout)["mask"][0][0] == keep[0, 0].int().tolist()


def test_a_flex_document_mask_of_40_documents_is_summarised_in_the_report_and_whole_in_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sizes = [4 + (i * 5) % 7 for i in range(40)]
    script = write(tmp_path, "docs.py", f"""
        import warnings
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        warnings.simplefilter("ignore")
        doc = torch.repeat_interleave(torch.arange(40), torch.tensor({sizes}))
        def mask_mod(b, h, q, kv):
            return (doc[q] == doc[kv]) & (kv <= q)
        L = {sum(sizes)}
        x = torch.randn(1, 1, L, 8)
        flex_attention(x, x, x, block_mask=create_block_mask(mask_mod, 1, 1, L, L, device="cpu"))
    """)
    # in a process of its own: dynamo's guards on an earlier test's __main__ fail a later flex program in this one
    done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", "t.json", script], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout + done.stderr
    text = " ".join(done.stderr.split())
    assert "document(sizes=[" + ",".join(map(str, sizes[:6])) + ",...], 40 documents)" in text
    assert "document(0,0,0" not in text
    labels = [d for d, size in enumerate(sizes) for _ in range(size)]  # every label, in --json
    assert json.load(open("t.json"))["groups"][0]["expression"] == "document(" + ",".join(map(str, labels)) + ")"


def test_past_max_bytes_a_call_keeps_its_shape_and_counts(layers, tmp_path):
    result = trace("--max-bytes", "0", "--save", "s.pt", layers, "--len", "4", env={"COLUMNS": "120"})
    assert result.exit_code == 0
    kept = 2 * sum(map(sum, window_reference(4, 4, 2)))  # two heads
    assert f"not kept (past --max-bytes 0): {kept} cells attended" in " ".join(result.stderr.split())
    shown = runner.invoke(app, ["show", "--mask", "s.pt:0"])
    assert shown.exit_code == 2 and "larger --max-bytes" in shown.stderr


@pytest.mark.parametrize("columns", ["60", "120"])
def test_the_report_reads_at_60_and_120_columns(layers, columns):
    result = trace(layers, "--odd", "1", env={"COLUMNS": columns})
    lines = result.stderr.splitlines()
    assert lines and all(len(line) <= int(columns) for line in lines), [line for line in lines if len(line) > int(columns)]
    assert "window(2)" in result.stderr and "window(3)" in result.stderr


def test_inspect_and_blocks_read_a_traced_call(layers):
    assert trace("--save", "b.pt", layers, "--len", "6", "--window", "3").exit_code == 0
    inspected = runner.invoke(app, ["inspect", "b.pt:layers.3.self_attn@0", "--json"])
    assert inspected.exit_code == 0, inspected.output
    report = json.loads(inspected.stdout)
    assert report["structure"] == "window(4)" and report["convention"] == "keep"
    blocks = runner.invoke(app, ["blocks", "--mask", "b.pt:0", "--block", "2", "--json"])
    assert blocks.exit_code == 0, blocks.output
    reference = np.array(window_reference(6, 6, 3))
    tiles = [reference[i : i + 2, j : j + 2] for i in range(0, 6, 2) for j in range(0, 6, 2)]  # 2 x 2 blocks, by hand
    wanted = {"full": sum(t.all() for t in tiles), "partial": sum(t.any() and not t.all() for t in tiles), "empty": sum(not t.any() for t in tiles)}
    counts = json.loads(blocks.stdout)["counts"][0]
    assert {name: counts[name] for name in wanted} == wanted


def test_a_decoder_with_left_padding_and_a_kv_cache_step_by_step(tmp_path, monkeypatch):
    from maskcli.tracefile import keep_of, load

    monkeypatch.chdir(tmp_path)
    result = trace("--save", "d.pt", "-m", "maskcli.trace.demo", "--len", "6", "--window", "3", "--steps", "2", env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stderr.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [row[4:7] for row in rows[1:]] == [["decode", "1", "(2,2,1,7)"], ["decode", "2", "(2,2,1,8)"]]
    assert [row[-1] for row in rows[1:]] == ["window(3)", "window(3)"] and rows[0][4] == "prefill"
    assert "query rows 0-1 of batch row 1 see no key at all" in " ".join(result.stderr.split())
    data = load("d.pt")
    for call in data["calls"]:
        keep = np.broadcast_to(keep_of(call, data), call["shape"])
        batch, heads, q_len, k_len = call["shape"]
        for b, h, i, k in np.ndindex(keep.shape):  # batch row 1's first two tokens are padding; queries at the end
            position = k_len - q_len + i
            assert keep[b, h, i, k] == (position - 3 < k <= position and not (b == 1 and k < 2)), (call["index"], b, i, k)


def test_steps_read_the_same_in_the_report_json_and_expect(tmp_path, monkeypatch):
    """prefill, then decode N for each one-query call after it: in the table, in --json's calls and groups, and in
    --expect's lines; a module's second call of several queries is step 1, not steps 1."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "twice.py", """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        class Attention(nn.Module):
            def forward(self, q, k):
                return F.scaled_dot_product_attention(q, k, k)

        attention = Attention()
        attention(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))  # prefill: 4 queries, no mask (full)
        attention(torch.randn(1, 1, 1, 8), torch.randn(1, 1, 5, 8))  # decode 1: one query
        attention(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))  # a second full-length call: step 2
    """)
    result = trace("--json", "run.json", "--expect", "*=causal", script, env={"COLUMNS": "120"})
    assert result.exit_code == 1, result.output
    rows = [line.split() for line in result.stderr.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [row[-5:] for row in rows] == [["prefill,", "step", "2", "(1,1,4,4)", "full"], ["sdpa", "decode", "1", "(1,1,1,5)", "causal"]]
    data = json.loads((tmp_path / "run.json").read_text())
    assert [c["step_label"] for c in data["calls"]] == ["prefill", "decode 1", "step 2"]
    assert [g["steps"] for g in data["groups"]] == ["prefill, step 2", "decode 1"]
    said = " ".join(result.stderr.split())
    assert "--expect *=causal: call 0 (Attention prefill, sdpa) differs from causal" in said


def test_files_are_written_where_maskcli_started_even_if_the_program_changes_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    script = write(tmp_path, "moves.py", """
        import os
        import torch
        import torch.nn.functional as F
        os.chdir("elsewhere")
        q = torch.randn(1, 1, 2, 4)
        F.scaled_dot_product_attention(q, q, q)
    """)
    result = trace("--save", "here.pt", "--json", "here.json", script)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "here.pt").is_file() and (tmp_path / "here.json").is_file()
    assert not (tmp_path / "elsewhere" / "here.pt").exists()
    folder = trace("--save", "elsewhere", script)
    assert folder.exit_code == 2 and "unknown extension '(none)'; use one of .pt" in folder.stderr and folder.stdout == ""
    (tmp_path / "elsewhere.pt").mkdir()
    directory = trace("--save", "elsewhere.pt", script)
    assert directory.exit_code == 2 and "is a directory" in directory.stderr and directory.stdout == ""


TUTORIAL = """
import torch
import torch.nn as nn


class MultiHeadAttention(nn.Module):  # as in the LLMs-from-scratch tutorial
    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        split = lambda t: t.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries, keys, values = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)


torch.manual_seed(123)
blocks = nn.Sequential(*(MultiHeadAttention(4, 4, 8, 2) for _ in range(3)))
print(blocks(torch.randn(2, 6, 4)).shape)
"""


def test_a_tutorials_masked_fill_attention_holds_to_causal_and_not_to_a_window(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "tutorial.py", TUTORIAL)
    held = trace("--expect", "*=causal", "--save", "tut.pt", script)
    assert held.exit_code == 0 and held.stdout == "torch.Size([2, 6, 4])\n"
    assert "{0-2} ×3  softmax  prefill  (2,2,6,6)  causal" in held.stderr
    shown = runner.invoke(app, ["show", "--mask", "tut.pt:2", "--json"])
    assert json.loads(shown.stdout)["mask"][1][1] == np.tril(np.ones((6, 6), dtype=int)).tolist()
    failed = trace("--expect", "1=window(2)", script)
    assert failed.exit_code == 1 and "call 1 (1 prefill, softmax) differs from window(2)" in " ".join(failed.stderr.split())


HF_EAGER = """
import torch
import torch.nn as nn


class EagerAttention(nn.Module):  # Hugging Face's eager path: scores + a min-filled mask, softmax in float32
    def forward(self, q, k, v, mask):
        scores = q @ k.transpose(2, 3) * q.shape[-1] ** -0.5 + mask
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return weights @ v


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": EagerAttention()}) for _ in range(2))

    def forward(self, x, mask, cache):
        for number, layer in enumerate(self.layers):
            cache[number] = torch.cat([cache[number], x], dim=2) if cache[number] is not None else x
            x = layer["self_attn"](x, cache[number], cache[number], mask)
        return x


def min_mask(real, queries):  # bottom-right causal and the key padding, filled with finfo.min where masked
    keys = real.shape[1]
    q = torch.arange(keys - queries, keys)[:, None]
    keep = (torch.arange(keys)[None, :] <= q)[None, None] & real[:, None, None, :]
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


torch.manual_seed(0)
model, cache = Model(), [None, None]
real = torch.tensor([[True] * 5, [False, False, True, True, True]])  # batch row 1 is left padded
x = model(torch.randn(2, 1, 5, 4), min_mask(real, 5), cache)
for _ in range(2):
    real = torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], dim=1)
    x = model(x[:, :, -1:], min_mask(real, 1), cache)
"""


def test_a_hugging_face_style_eager_model_with_left_padding_step_by_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "eager.py", HF_EAGER)
    result = trace("--json", "e.json", "--save", "e.pt", "--expect", "layers.*.self_attn=causal", script, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "e.json").read_text())
    assert [(c["where"], c["step"], c["shape"]) for c in data["calls"]] == [
        ("layers.0.self_attn", 0, [2, 1, 5, 5]), ("layers.1.self_attn", 0, [2, 1, 5, 5]),
        ("layers.0.self_attn", 1, [2, 1, 1, 6]), ("layers.1.self_attn", 1, [2, 1, 1, 6]),
        ("layers.0.self_attn", 2, [2, 1, 1, 7]), ("layers.1.self_attn", 2, [2, 1, 1, 7]),
    ]
    assert all(c["api"] == "softmax" and c["details"]["fill"] == "min" for c in data["calls"])
    text = " ".join(result.stderr.split())
    assert "query rows 0-1 of batch row 1 see no key at all: uniform weights over every key there, masked ones included" in text
    assert "every call matched holds" in text
    assert [group["name"] for group in data["groups"]] == [
        "causal (--lengths 5,3 --pad left)", "causal (--lengths 6,4 --pad left)", "causal (--lengths 7,5 --pad left)"]
    from maskcli.tracefile import keep_of, load

    saved = load("e.pt")
    for call in saved["calls"]:  # a double loop: queries at the end, causal, batch row 1's first two keys padding
        keep = np.broadcast_to(keep_of(call, saved), call["shape"])
        _, _, q_len, k_len = call["shape"]
        for b, h, i, k in np.ndindex(keep.shape):
            assert keep[b, h, i, k] == (k <= k_len - q_len + i and not (b == 1 and k < 2))


@given(st.lists(st.integers(1, 9), min_size=1, max_size=30), st.integers(0, 3))
def test_brief_names_long_labels_by_their_runs_and_leaves_short_ones(sizes, extra):
    from maskcli.render.trace import brief

    labels = ",".join(str(d) for d, size in enumerate(sizes) for _ in range(size))
    text = f"causal & document({labels}) & window({extra + 1})"
    if sum(sizes) <= 12:
        assert brief(text) == text
    elif len(sizes) <= 12:  # every size shown: a name that pastes back, the same mask as the labels
        from maskcli.mask import MaskOptions, build

        assert brief(text) == f"causal & document(sizes=[{','.join(map(str, sizes))}]) & window({extra + 1})"
        options = MaskOptions(length=sum(sizes))
        assert np.array_equal(build(brief(text), options).dense(), build(text, options).dense())
    else:
        expected = f"document(sizes=[{','.join(map(str, sizes[:6]))},...], {len(sizes)} documents)"
        assert brief(text) == f"causal & {expected} & window({extra + 1})"
    assert brief("not ( an expression") == "not ( an expression"


def test_api_completes_the_last_name_after_a_comma():
    from maskcli.commands.trace import complete_apis

    assert complete_apis("") == ["sdpa", "flex", "mha", "softmax", "flash", "hf", "vllm"]
    assert complete_apis("sdpa,f") == ["sdpa,flex", "sdpa,flash"] and complete_apis("flash,h") == ["flash,hf"]
    assert complete_apis("flex,fl") == ["flex,flash"]  # a name already given is not offered again


def test_a_hugging_face_model_with_a_registered_attention_function_is_reported_per_layer(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    script = write(tmp_path, "packed.py", """
        import torch
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM


        def own(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            out = torch.zeros_like(query)  # attention one document at a time, on 2-D scores
            cu = kwargs["cu_seq_lens_q"].tolist()
            for h in range(query.shape[1]):
                for a, b in zip(cu[:-1], cu[1:]):
                    scores = (query[0, h, a:b] @ key[0, h, a:b].T) * scaling
                    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
                    out[0, h, a:b] = torch.softmax(scores, -1) @ value[0, h, a:b]
            return out.transpose(1, 2), None


        AttentionInterface.register("own_documents", own)
        config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=32)
        model = LlamaForCausalLM(config).eval()
        model.set_attn_implementation("own_documents")
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        with torch.no_grad():
            model(torch.arange(1, 6)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=3, max_length_k=3)
        print("ran")
    """)
    result = trace("--json", "run.json", script, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert result.stdout == "ran\n"
    assert "0  model.layers.{0-2}.self_attn ×3  hf   prefill  (1,2,5,5)  document(0,0,1,1,1)" in result.stderr
    calls = json.loads((tmp_path / "run.json").read_text())["calls"]
    assert [(c["api"], c["details"]["hf"]["layer_idx"], c["details"]["hf"]["attn_implementation"]) for c in calls] == [
        ("hf", 0, "own_documents"), ("hf", 1, "own_documents"), ("hf", 2, "own_documents")]
    assert calls[0]["details"]["implicit"] == "cu_seq_lens_q/k" and calls[0]["details"]["hf"]["cu_seq_lens_k"] == [0, 2, 5]


def test_a_gqa_decode_under_hfs_sdpa_saves_one_query_at_its_position_and_holds_to_causal(tmp_path, monkeypatch):
    """HF's sdpa packs one query's heads as query rows (pack_gqa): the call is saved as the model computed it, one
    query at the last key, and show reads it back there (a double loop from the padding and positions)."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    script = write(tmp_path, "gqa.py", """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=1, vocab_size=32, pad_token_id=0)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        model.set_attn_implementation("sdpa")
        ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
        with torch.no_grad():
            model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                           pad_token_id=0)
    """)
    result = trace("--save", "run.pt", "--expect", "*=causal", script, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "--expect: every call matched holds (1 expectation)" in result.stderr
    shown = runner.invoke(app, ["show", "--mask", "run.pt:1", "--json"])  # the decode step: 6 keys
    assert shown.exit_code == 0, shown.output
    cells = json.loads(shown.stdout)["mask"]
    valid = [[0, 0, 1, 1, 1, 1], [1] * 6]
    want = [[[[int(valid[b][k] and k <= 5) for k in range(6)]] for _ in range(4)] for b in range(2)]
    assert cells == want


def test_the_annotated_transformers_encoder_and_decoder_are_apart_in_expect_and_in_the_saved_trace(tmp_path, monkeypatch):
    """greedy_decode calls model.encode and model.decode on their own: --expect patterns and TRACE.pt:PATH@STEP name
    the decoder's layers (causal, one step per decoded token) apart from the encoder's (the source's padding)."""
    import os

    monkeypatch.chdir(tmp_path)
    script = os.path.join(os.path.dirname(__file__), "programs", "annotated_transformer.py")
    result = trace("--expect", "decoder.layers.*.self_attn=causal", "--save", "a.pt", script)
    assert result.exit_code == 0, result.output
    assert "--expect: every call matched holds (1 expectation)" in result.stderr
    wrong = trace("--expect", "*.self_attn=causal", script)  # the encoder's self-attention is not causal
    said = " ".join(wrong.stderr.split())
    assert wrong.exit_code == 1 and "call 0 (encoder.layers.0.self_attn prefill, softmax) differs from causal" in said
    assert "--expect *.self_attn=causal: 1 more call differs: 1" in said  # call 1, encoder.layers.1; no decoder call
    for step in range(3):
        shown = runner.invoke(app, ["show", "--mask", f"a.pt:decoder.layers.0.self_attn@{step}", "--json"])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["mask"][0][0] == [[int(j <= i) for j in range(step + 1)] for i in range(step + 1)]
    encoder = runner.invoke(app, ["show", "--mask", "a.pt:encoder.layers.1.self_attn", "--json"])  # one call: no @STEP
    assert json.loads(encoder.stdout)["mask"][0][0] == [[int(j < 6) for j in range(8)] for _ in range(8)]


def test_calls_made_in_the_programs_threads_are_reported_and_its_threads_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "threads.py", """
        import threading
        import torch
        import torch.nn.functional as F

        def attend(length):
            q = torch.randn(1, 1, length, 4)
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

        workers = [threading.Thread(target=attend, args=(n,), name=f"worker-{n}") for n in (3, 4, 5)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        attend(2)
    """)
    result = trace("--json", "t.json", script, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "4 attention calls in 4 groups" in result.stderr
    assert "3 threads the program started made attention calls, traced as well: worker-" in result.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    assert sorted(call["details"].get("thread", "main") for call in data["calls"]) == ["main", "worker-3", "worker-4", "worker-5"]
    (note,) = data["notes"]
    assert sorted(note.split(": ")[1].split(", ")) == ["worker-3", "worker-4", "worker-5"]


def test_inspect_of_a_traced_mha_call_reads_its_padding_from_key_padding_mask(tmp_path, monkeypatch):
    """An inverted tril (MHA reads True = masked) with batch row 1's keys 4-5 padded by key_padding_mask: inspect of
    the saved call names that padding, as trace does, not key 0 (which no query sees for the inversion)."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "inverted.py", """
        import torch
        import torch.nn as nn
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(8, 2, batch_first=True)
        x = torch.randn(2, 6, 8)
        mha(x, x, x, attn_mask=torch.tril(torch.ones(6, 6, dtype=torch.bool)),
            key_padding_mask=torch.tensor([[False] * 6, [False] * 4 + [True] * 2]))
    """)
    assert trace("--save", "i.pt", script).exit_code == 1  # NaN rows: MHA with need_weights runs its own softmax
    inspected = runner.invoke(app, ["inspect", "i.pt:0", "--json"])
    command = json.loads(inspected.stdout)["command"]
    assert command == 'maskcli show "triu(1, means=keep)" --lengths 6,4 --heads 2'
    shown = runner.invoke(app, ["show", "triu(1, means=keep)", "--lengths", "6,4", "--json"])
    keep = np.zeros((2, 6, 6), dtype=bool)  # a double loop: strictly later keys, batch row 1's keys 4-5 padding
    for b, i, k in np.ndindex(2, 6, 6):
        keep[b, i, k] = k > i and not (b == 1 and k >= 4)
    assert np.array_equal(np.asarray(json.loads(shown.stdout)["mask"], dtype=bool)[:, 0], keep)


DEEP = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Core(nn.Module):
    def forward(self, x, mask):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_core = Core()

    def forward(self, x, mask):
        return self.attention_core(x, mask)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention_block = SelfAttention()

    def forward(self, x, mask):
        return self.self_attention_block(x, mask)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer_layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x, mask):
        for layer in self.transformer_layers:
            x = layer(x, mask)
        return x


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.language_model_decoder = Model()

    def forward(self, x, mask):
        return self.language_model_decoder(x, mask)


q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
lengths = torch.tensor([9, 7, 5, 3, 8])
mask = (k <= q)[None, None] & (k[None, None] < lengths[:, None, None, None])
Outer()(torch.randn(5, 2, 9, 4), mask)
"""


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_a_long_module_path_and_padding_list_wrap_between_tokens_under_their_text(tmp_path, monkeypatch, columns):
    from collections import Counter

    from maskcli.render.breaking import tokens

    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "deep.py", DEEP)
    result = trace("--expect", "*=window(2)", script, env={"COLUMNS": str(columns)})
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert all(len(line) <= columns for line in lines), [line for line in lines if len(line) > columns]

    def words(text: str) -> Counter:  # every token (a path's part up to its '.', a list's number with its ',')
        return Counter(t.strip() for line in text.splitlines() for t in tokens(line) if any(c.isalnum() for c in t))

    # what the report must say whole, written here: the path, the padding (rows 1-4 shorter: 7,5,3,8 keys), the mask
    path = "language_model_decoder.transformer_layers.{0-1}.self_attention_block.attention_core ×2"
    expected = Counter(t.strip() for t in tokens(f"{path} causal (--lengths 9,7,5,3,8)"))
    seen = words(result.stderr)
    assert expected - seen == Counter(), expected - seen  # none split across lines, none lost
    wide = trace("--expect", "*=window(2)", script, env={"COLUMNS": "400"})
    header = Counter(["#", "calls", "api", "step", "shape", "mask", "0"])  # the table's; narrower, the group is '#0 '
    assert words(wide.stderr) - header - seen == Counter()  # every word of the unwrapped report, whole
    for line in lines:  # a wrapped line stands under its text: only a report line's own start is at column 0
        assert line == "" or re.match(r"maskcli trace |#\d+ |\d+: |--expect | +#? +calls| ─| \d+  |   ", line), line
    assert any(line.startswith("   ") for line in lines)  # it did wrap


def test_groups_past_the_first_named_are_counted_in_one_line_and_listed_in_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("maskcli.trace.report.NAMED", 3)
    script = write(tmp_path, "many.py", LAYERS + """
x = torch.randn(1, 2, 8, 4)
for width in (2, 3, 4, 5, 6, 7, 2, 6):  # six distinct masks, two of them given twice
    F.scaled_dot_product_attention(x, x, x, attn_mask=window(8, width))
""")
    result = trace("--json", "t.json", "--save", "t.pt", script, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "8 attention calls in 6 groups" in result.stderr
    rows = [line.split()[-1] for line in result.stderr.splitlines() if line.strip()[:1].isdigit() and "sdpa" in line]
    assert rows == ["window(2)", "window(3)", "window(4)"]  # the first three groups only, each named
    said = " ".join(result.stderr.split())
    assert "3 more groups (4 calls) counted, not named: trace names and checks the first 3 groups one by one" in said
    data = json.loads((tmp_path / "t.json").read_text())
    assert [g["named"] for g in data["groups"]] == [True, True, True, False, False, False]
    assert [g["calls"] for g in data["groups"]] == [[0, 6], [1], [2], [3], [4, 7], [5]]
    assert [g["name"] for g in data["groups"][3:]] == ["not named: past the first 3 groups"] * 3
    for g, width in zip(data["groups"], (2, 3, 4, 5, 6, 7)):  # counted or named, each call's mask is kept whole
        shown = runner.invoke(app, ["show", "--mask", f"t.pt:{g['calls'][-1]}", "--json"])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["mask"][0][0] == window_reference(8, 8, width)


def test_an_excepthook_the_program_sets_is_its_own_and_ends_with_it(tmp_path, monkeypatch):
    """The program's hook prints its error (as python calls it), and is gone once the program is: torch.distributed
    sets one for good at init_process_group, and maskcli's own errors after the run are not the program's."""
    monkeypatch.chdir(tmp_path)
    before = sys.excepthook
    script = write(tmp_path, "hooked.py", """
        import sys
        sys.excepthook = lambda kind, error, tb: print("hooked:", error, file=sys.stderr)
        raise ValueError("boom")
    """)
    result = trace(script)
    assert result.exit_code == 1 and result.stderr.startswith("hooked: boom\n")
    assert sys.excepthook is before


HOSTILE_CONFIG = """
import torch, torch.nn as nn, torch.nn.functional as F
reads = []
class Config:
    def __getattr__(self, name):  # every name it lacks: counted, then refused (python reads none of them)
        if name.startswith("__"):
            raise AttributeError(name)
        reads.append(name)
        raise AttributeError(name)
class Odd:
    def __getattr__(self, name):  # every name: an object that refuses to be compared or tested
        if name.startswith("__"):
            raise AttributeError(name)
        return Odd()
    def __bool__(self):
        raise TypeError("bool of Odd")
    def __eq__(self, other):
        raise TypeError("eq of Odd")
    __hash__ = None
class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
    def forward(self, input_ids, attention_mask=None):
        x = torch.randn(input_ids.shape[0], 2, input_ids.shape[1], 4)
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)
config = Odd() if "odd" in __import__("sys").argv else Config()
out = Model(config)(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long))
print("reads", len(reads), list(out.shape))
"""


@pytest.mark.parametrize("which", ["counting", "odd"])
def test_a_config_whose_attribute_reads_are_the_programs_code_runs_as_under_python(tmp_path, monkeypatch, which):
    """hunt 7: trace ran a config's __getattr__ for every field it looks for (the program printed "reads 24" where
    python prints "reads 0"), and a rule's read of a config answering an object whose __bool__ / __eq__ raise ended in
    "unexpected TypeError"; the program's stdout is python's, and the one call is read."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "hostile_config.py", HOSTILE_CONFIG)
    python = subprocess.run([sys.executable, script, which], capture_output=True, text=True, timeout=300)
    result = trace(script, which)
    assert result.exit_code == python.returncode == 0, (result.output, python.stderr)
    assert result.stdout == python.stdout == "reads 0 [2, 2, 5, 4]\n"
    assert "maskcli bug" not in result.stderr and "1 attention call in 1 group" in result.stderr
    assert "causal" in result.stderr


def test_a_layer_that_holds_itself_is_traced_as_python_runs_it(tmp_path, monkeypatch):
    """hunt 7: a function handed a module that holds itself (`layer.self_attn = layer`) made trace loop forever looking
    for the module's parameters; python runs it at once. The program's output is python's and its calls are read."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "itself.py", """
        import torch, torch.nn as nn
        layer = nn.Module()
        layer.proj = nn.Linear(4, 4)
        layer.self_attn = layer
        def attention_forward(self, x):
            s = x @ x.transpose(-1, -2)
            s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
            return s.softmax(-1) @ x
        print(list(attention_forward(layer, torch.randn(1, 2, 5, 4)).shape))
    """)
    result = trace(script)
    assert result.exit_code == 0, result.output
    assert result.stdout == "[1, 2, 5, 4]\n"
    assert "1 attention call in 1 group" in result.stderr and "causal" in result.stderr


def test_a_call_at_the_programs_top_level_has_no_caller_of_maskclis(tmp_path, monkeypatch):
    """hunt 7: --json said the caller of a call made at a script's top level was typer's "main.py:1519" (the CLI that
    ran the program); the program's outermost line has no caller of the program's: "?"."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "top.py", """
        import torch, torch.nn.functional as F
        x = torch.randn(1, 2, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
    """)
    result = trace("--json", "t.json", script)
    assert result.exit_code == 0, result.output
    assert [call["details"].get("caller") for call in json.loads((tmp_path / "t.json").read_text())["calls"]] == ["?"]


def test_a_warning_torch_raises_in_a_followed_call_is_shown_at_the_programs_line(tmp_path, monkeypatch):
    """hunt 7: float() of a softmax's weights (a tensor the trace follows, its __float__ run by the trace's mode) warned
    at maskcli's line `out = call(*args, **kwargs)`; python shows the program's own line, as trace now does."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "warns.py", """
        import torch
        q = torch.randn(5, 8, requires_grad=True)
        w = torch.softmax(q.mm(q.T).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf")), -1)
        total = float(w.sum())
    """)
    python = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    result = subprocess.run([sys.executable, "-m", "maskcli", "trace", script], capture_output=True, text=True,
                            timeout=300)  # (its own process: pytest records warnings raised in this one)
    assert result.returncode == python.returncode == 0, result.stderr
    warned = [line for line in python.stderr.splitlines() if "UserWarning" in line or line.startswith("  total")]
    assert len(warned) == 2 and "warns.py:5: UserWarning" in warned[0], python.stderr
    assert result.stderr.startswith("\n".join([warned[0], python.stderr.splitlines()[1], warned[1]])), result.stderr[:600]
    assert "call(*args" not in result.stderr


def test_a_negative_cache_position_states_no_place_for_the_queries(tmp_path, monkeypatch):
    """hunt 7: a model call handed cache_position=[-3, -2, -1, 0, 1] (which its model never reads) made unwritten-slot
    say "query -1 sees cache slot 2 ... holds no key yet", exit 1, on a correct causal program. A slot below 0 is no
    slot: the call states no place, and the causal mask stands alone."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "negpos.py", """
        import torch, torch.nn as nn, torch.nn.functional as F
        class Model(nn.Module):
            def forward(self, input_ids, cache_position=None):
                x = torch.randn(input_ids.shape[0], 2, input_ids.shape[1], 4)
                return F.scaled_dot_product_attention(x, x, x, is_causal=True)
        print(list(Model()(torch.ones(2, 5, dtype=torch.long), cache_position=torch.tensor([-3, -2, -1, 0, 1])).shape))
    """)
    result = trace(script)
    assert result.exit_code == 0, result.output
    assert result.stdout == "[2, 2, 5, 4]\n" and "unwritten-slot" not in result.stderr and "causal" in result.stderr


HOSTILE_OBJECTS = {  # (objects the program holds beside its attention call, which fight every attribute read)
    "getattribute": "type('H', (), {'__getattribute__': lambda s, n: (_ for _ in ()).throw(RuntimeError('no ' + n))})()",
    "sysexit": "type('H', (), {'__getattr__': lambda s, n: (_ for _ in ()).throw(SystemExit(9))})()",
    "class_property": "type('H', (), {'__class__': property(lambda s: 1 / 0)})()",
    "dict_property": "type('H', (), {'__dict__': property(lambda s: 1 / 0)})()",
}


@pytest.mark.parametrize("hostile", sorted(HOSTILE_OBJECTS))
def test_an_object_that_fights_being_read_in_the_programs_frames_changes_nothing(tmp_path, monkeypatch, hostile):
    """hunt 8: an object whose __getattribute__ raises, held as `attention_mask` / `past_key_values` / `meta` where the
    call is made, crashed the program under trace (isinstance asks __class__) or exited it with status 9 (a SystemExit
    out of `get_seq_length`); one whose __class__ or __dict__ raises left every call "not read". Now the program runs
    as under python and its causal call is read: the report names it causal, as torch.tril says it is."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "hostile.py", f"""
        import torch, torch.nn as nn, torch.nn.functional as F
        class Attn(nn.Module):
            def forward(self, x, attention_mask=None, past_key_values=None):
                meta = attention_mask
                return F.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool).tril())
        h = {HOSTILE_OBJECTS[hostile]}
        print(list(Attn()(torch.ones(2, 2, 5, 4), attention_mask=h, past_key_values=h).shape))
    """)
    python = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    result = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", "t.json", script], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == python.returncode == 0 and result.stdout == python.stdout == "[2, 2, 5, 4]\n", result.stderr
    calls = json.loads((tmp_path / "t.json").read_text())["calls"]
    assert len(calls) == 1 and "error" not in calls[0]["details"], calls
    assert "not read" not in result.stderr and "causal" in result.stderr, result.stderr


def test_a_softmax_or_fill_whose_subclass_returns_no_tensor_is_returned_untouched(tmp_path, monkeypatch):
    """hunt 8: what a watched call returns is the program's, whatever it is: a Tensor subclass whose __torch_function__
    hands back a tuple for softmax and masked_fill, and None for matmul, runs and prints as under python."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "odd.py", """
        import torch
        class T(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                out = super().__torch_function__(func, types, args, kwargs or {})
                name = getattr(func, "__name__", "")
                return (out, "x") if name in ("softmax", "masked_fill") else None if name in ("matmul", "__matmul__") else out
        q = torch.randn(2, 2, 4, 8)
        s = (q @ q.transpose(-1, -2)).as_subclass(T)
        print(type(s.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -1e9)).__name__,
              type(s.softmax(-1)).__name__, q.as_subclass(T) @ q.transpose(-1, -2))
    """)
    python = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    result = subprocess.run([sys.executable, "-m", "maskcli", "trace", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == python.returncode == 0 and result.stdout == python.stdout == "tuple tuple None\n", result.stderr
    assert "Traceback" not in result.stderr and "maskcli bug" not in result.stderr


def test_a_program_that_wraps_masked_fill_or_counts_in_its_subclass_sees_each_of_its_calls_once(tmp_path, monkeypatch):
    """hunt 9: a program that replaces Tensor.masked_fill and Tensor.softmax with wrappers of its own (which call the
    builtins they kept) and a Tensor subclass that counts what its __torch_function__ is handed see the program's calls
    once each, as under python (the mode was handed the wrapper again for the builtin's call; maskcli's own reads of
    the tensors reached the subclass); the causal calls are still read."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "wrapped.py", """
        import torch, torch.nn.functional as F
        kept_fill, kept_softmax, seen = torch.Tensor.masked_fill, torch.Tensor.softmax, {}
        def fill(self, *args, **kwargs):
            seen["fill"] = seen.get("fill", 0) + 1
            return kept_fill(self, *args, **kwargs)
        def softmax(self, *args, **kwargs):
            seen["softmax"] = seen.get("softmax", 0) + 1
            return kept_softmax(self, *args, **kwargs)
        torch.Tensor.masked_fill, torch.Tensor.softmax = fill, softmax
        class Logged(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "?")
                seen[name] = seen.get(name, 0) + 1
                return super().__torch_function__(func, types, args, kwargs or {})
        q = torch.randn(1, 2, 5, 4)
        above = torch.ones(5, 5, dtype=torch.bool).triu(1)
        for step in range(2):
            s = q @ q.transpose(-1, -2)
            w = s.masked_fill(above, float("-inf")).softmax(-1)
            ql = q.as_subclass(Logged)
            w2 = F.softmax((ql @ ql.transpose(-1, -2)).masked_fill(above, -1e9), -1)
        print(sorted(seen.items()), round(float(w.sum()), 3), round(float(w2.sum()), 3))
    """)
    python = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    result = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--save", "t.pt", script], capture_output=True,
                            text=True, timeout=300)
    assert python.returncode == 0 and python.stdout.startswith("[('fill', 8), ('matmul', 2), ('softmax', 6)"), python.stdout
    assert result.returncode == 0 and result.stdout == python.stdout, (result.stdout, python.stdout, result.stderr)
    from maskcli.tracefile import keep_of, load

    data = load(str(tmp_path / "t.pt"))
    assert len(data["calls"]) == 4, data["calls"]
    for call in data["calls"]:
        keep = np.broadcast_to(keep_of(call, data), call["shape"])
        assert call["shape"] == [1, 2, 5, 5] and (keep == np.tril(np.ones((5, 5), dtype=bool))).all(), call
