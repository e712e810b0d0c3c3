"""maskcli.trace.compiled: calls of torch.compile'd code are counted and named, what was seen inside them said, and
TORCHDYNAMO_DISABLE=1 (read by torch._dynamo.eval_frame._optimize at each torch.compile, torch 2.13 line 1752: it
then returns the function unchanged) lets trace see every call with its module."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import maskcli

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "programs"))


def attend(q):
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_compiled_code_is_counted_named_and_its_unseen_attention_said():
    """aot_eager runs its graph as aten operators, which no TorchFunctionMode sees: both calls made, none seen."""
    fast = torch.compile(attend, backend="aot_eager")
    with maskcli.trace() as t:
        outs = [fast(torch.randn(1, 1, 3, 4)) for _ in range(2)]  # (one shape: compiled once)
    assert t.calls == [] and [o.shape[2] for o in outs] == [3, 3]
    assert t.notes() == ["2 calls of torch.compile'd code ran (attend ×2): attention inside it is not recorded; run with "
                         "TORCHDYNAMO_DISABLE=1 in the environment to run it eagerly and trace every call with its module"]


def test_nanogpt_sampled_through_torch_compile_and_with_dynamo_disabled(monkeypatch):
    import nanogpt

    with maskcli.trace() as t:  # dynamo's eager backend runs its graph in Python: calls seen, module paths lost
        compiled = nanogpt.sample(compile=True, max_new_tokens=1)  # (one length: compiled once)
    assert len(t.calls) == 2 and all(c.details.get("compiled") for c in t.calls)
    assert t.notes()[0].startswith("1 call of torch.compile'd code ran (GPT ×1): 2 attention calls inside it seen only ")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with maskcli.trace() as t:
        eager = nanogpt.sample(compile=True, max_new_tokens=1)
    assert torch.equal(compiled, eager) and t.notes() == []
    assert [(c.where, c.step, c.shape[2]) for c in t.calls] == [(f"transformer.h.{n}.attn", 0, 3) for n in range(2)]
    for call in t.calls:
        assert np.array_equal(call.keep()[0, 0], np.tril(np.ones((call.shape[2],) * 2, dtype=bool)))


def test_a_program_transformers_compiles_under_generate_runs_to_its_end(tmp_path):
    """On CUDA, generate with a static cache compiles the model's forward itself (transformers 5.24,
    generation/utils.py _valid_auto_compile_criteria); dynamo then traced maskcli's mode into its graph, and
    Gemma 3's rotary `cos.to(dtype=x.dtype)` got a tensor for a dtype: the traced program died (seen on an H200).
    Here the criteria are forced on the CPU: the program runs to its end, its eager calls are traced, the compiled
    call is counted."""
    import json
    from pathlib import Path

    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from typer.testing import CliRunner

    from maskcli.commands import app

    bug = Path(__file__).parent / "data" / "bugs" / "gemma3_generate_drops_image_spans.py"
    program = tmp_path / "compiled_generate.py"
    program.write_text("import runpy, sys\nfrom transformers.generation.utils import GenerationMixin\n"
                       "criteria = GenerationMixin._valid_auto_compile_criteria\n"
                       "GenerationMixin._valid_auto_compile_criteria = lambda self, *a, **k: True\n"
                       f"sys.argv = [{str(bug)!r}, '--fixed']\n"
                       "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                       "finally:  # (trace runs it in this process: later tests' generate must not compile)\n"
                       "    GenerationMixin._valid_auto_compile_criteria = criteria\n")
    out = tmp_path / "t.json"
    result = CliRunner().invoke(app, ["trace", "--json", str(out), str(program)])
    data = json.loads(out.read_text())
    assert data["exit_status"] == 0 and result.exit_code == 0, result.output
    assert data["calls"] and any("torch.compile'd code ran (Gemma3" in note for note in data["notes"]), result.output
