"""maskcli.trace.compiled: calls of torch.compile'd code are counted and named, their attention calls recorded at a
graph break made while tracing (or said unseen under fullgraph=True), and TORCHDYNAMO_DISABLE=1 (read by torch._dynamo.eval_frame._optimize at each torch.compile, torch 2.13 line 1752: it
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


class Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, q):
        length = q.shape[2]
        position = torch.arange(length)
        keep = (position[None, :] <= position[:, None]) & (position[:, None] - position[None, :] < self.width)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=keep) * 2


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(2), Layer(3)])

    def forward(self, q):
        for layer in self.layers:
            q = layer(q)
        return q


def window(length: int, width: int) -> np.ndarray:
    """A double loop: query i sees keys i-width+1 .. i."""
    return np.array([[i - width < j <= i for j in range(length)] for i in range(length)])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_attention_inside_compiled_code_is_a_graph_break_while_tracing_and_recorded_with_its_module(backend):
    """aot_eager and inductor run their graphs as aten operators, which no TorchFunctionMode sees: while tracing, each
    attention call dynamo meets in the mode is a graph break (a torch._dynamo.disable'd call), so it runs eagerly,
    recorded with the modules its frames run in; the results are the compiled model's without trace."""
    torch.manual_seed(0)
    model = Model()
    fast = torch.compile(model, backend=backend)
    x = torch.randn(1, 2, 5, 8)
    with maskcli.trace() as t:
        outs = [fast(x) for _ in range(2)]  # (one shape: compiled once)
    assert all(torch.allclose(out, model(x), atol=1e-5) for out in outs)
    assert [(c.where, c.step) for c in t.calls] == [("layers.0", 0), ("layers.1", 0),
                                                    ("layers.0", 1), ("layers.1", 1)]
    for call, width in zip(t.calls, (2, 3, 2, 3)):
        assert np.array_equal(call.keep()[0, 0], window(5, width)) and call.details.get("compiled")
    assert t.notes() == ["2 calls of torch.compile'd code ran (Model ×2): 4 attention calls inside it recorded, each a "
                         "graph break while tracing"]


def test_attention_compiled_with_fullgraph_is_left_in_its_graph_and_said_unseen():
    """fullgraph=True makes a graph break the program's error: there the call stays in the graph, unrecorded, and
    the note says so and how to see it (TORCHDYNAMO_DISABLE=1)."""
    fast = torch.compile(attend, backend="aot_eager", fullgraph=True)
    x = torch.randn(1, 1, 3, 4)
    with maskcli.trace() as t:
        outs = [fast(x) for _ in range(2)]
    assert t.calls == [] and all(torch.allclose(out, attend(x)) for out in outs)
    assert t.notes() == ["2 calls of torch.compile'd code ran (attend ×2): attention compiled with fullgraph=True "
                         "(where no graph break is allowed) is not recorded; run with TORCHDYNAMO_DISABLE=1 in the "
                         "environment to run it eagerly and trace every call with its module"]


def test_nanogpt_sampled_through_torch_compile_and_with_dynamo_disabled(monkeypatch):
    import nanogpt

    with maskcli.trace() as t:  # each attention call a graph break: recorded with its module, as eagerly
        compiled = nanogpt.sample(compile=True, max_new_tokens=1)  # (one length: compiled once)
    assert [(c.where, c.step, c.shape[2]) for c in t.calls] == [(f"transformer.h.{n}.attn", 0, 3) for n in range(2)]
    assert all(c.details.get("compiled") for c in t.calls)
    assert t.notes() == ["1 call of torch.compile'd code ran (GPT ×1): 2 attention calls inside it recorded, each a "
                         "graph break while tracing"]
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with maskcli.trace() as t:
        eager = nanogpt.sample(compile=True, max_new_tokens=1)
    assert torch.equal(compiled, eager) and t.notes() == []
    assert [(c.where, c.step, c.shape[2]) for c in t.calls] == [(f"transformer.h.{n}.attn", 0, 3) for n in range(2)]
    for call in t.calls:
        assert np.array_equal(call.keep()[0, 0], np.tril(np.ones((call.shape[2],) * 2, dtype=bool)))


def test_a_backend_computing_scores_while_dynamo_compiles_leaves_the_mode_stack_as_dynamo_saved_it():
    """Dynamo saves the torch function mode stack as it starts compiling a frame and checks it unchanged when it builds
    the frame's guards. A backend's own q @ kᵀ (here a check of attention-shaped products, kept) once made the trace
    follow it and push its mode in the middle of that compile: dynamo raised "Guard failed on the same frame it was
    created ... ___check_torch_function_mode_stack()" and the correct program died (as Gemma 3's compiled generate did
    once in CI). What runs while dynamo compiles is dynamo's, not the program's: it passes untraced, and the program's
    own attention is recorded as without the backend's work."""
    kept = []

    def backend(gm, example_inputs):
        q = torch.randn(1, 2, 4, 8)
        kept.append(q @ q.transpose(-1, -2))  # (followed were it the program's: scores alive past the compile)
        return gm.forward

    def scaled(q):  # (ops around the attention call: graphs for the backend on both sides of its break)
        return attend(q * 2) + 1

    fast = torch.compile(scaled, backend=backend)
    x = torch.randn(1, 2, 4, 8)
    with maskcli.trace() as t:
        outs = [fast(x) for _ in range(2)]
    assert len(kept) == 2 and all(torch.allclose(out, scaled(x), atol=1e-6) for out in outs)
    assert torch.overrides._get_current_function_mode_stack() == []
    assert [(c.api, c.shape) for c in t.calls] == [("sdpa", (1, 2, 4, 4))] * 2
    for call in t.calls:
        assert np.array_equal(call.keep()[0, 0], np.tril(np.ones((4, 4), dtype=bool)))


def test_a_program_transformers_compiles_under_generate_runs_to_its_end(tmp_path):
    """On CUDA, generate with a static cache compiles the model's forward itself (transformers 5.24,
    generation/utils.py _valid_auto_compile_criteria); dynamo then traced maskcli's mode into its graph, and
    Gemma 3's rotary `cos.to(dtype=x.dtype)` got a tensor for a dtype: the traced program died (seen on an H200).
    Here the criteria are forced on the CPU: the program runs to its end, its eager calls are traced, the compiled
    call is counted. `maskcli trace` runs in a process of its own, as a user runs it. (In CI this program once died of
    dynamo's "Guard failed on the same frame it was created ... ___check_torch_function_mode_stack()": torch calls made
    while dynamo compiled pushed the trace's mode; the test above makes that happen every time.)"""
    import json
    import subprocess
    from pathlib import Path

    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    bug = Path(__file__).parent / "data" / "bugs" / "gemma3_generate_drops_image_spans.py"
    program = tmp_path / "compiled_generate.py"
    program.write_text("import runpy, sys\nfrom transformers.generation.utils import GenerationMixin\n"
                       "GenerationMixin._valid_auto_compile_criteria = lambda self, *a, **k: True\n"
                       f"sys.argv = [{str(bug)!r}, '--fixed']\n"
                       "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = tmp_path / "t.json"
    done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program)],
                          capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert data["exit_status"] == 0 and done.returncode == 0, done.stdout + done.stderr
    assert data["calls"] and any("torch.compile'd code ran (Gemma3" in note for note in data["notes"]), done.stdout
