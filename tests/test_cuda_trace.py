"""trace on programs that run on a CUDA device: every reproduction in tests/data/bugs run with CUDA as torch's default
device is traced as on the CPU (the same masks, the same findings, the same exit status), and its calls say cuda. A
program that does not run on CUDA by itself (a CPU generator, numpy arrays made tensors beside default-device ones) is
skipped, saying why.

Marked `cuda`, skipped where torch sees no CUDA device (`pytest -m cuda`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from maskcli.commands import app

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BUGS = Path(__file__).parent / "data" / "bugs"
runner = CliRunner()

ON = """import importlib.util, runpy, sys, torch
spec = importlib.util.spec_from_file_location("cuda_draws", {draws!r})
draws = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draws)
draws.drawn_on_the_cpu()
torch.set_default_device({device!r})
sys.argv = [{program!r}, *sys.argv[1:]]
runpy.run_path({program!r}, run_name="__main__")
"""


def _program(tmp_path, name, device) -> Path:
    program = tmp_path / f"{name}_{device}.py"
    program.write_text(ON.format(draws=str(Path(__file__).parent / "cuda_draws.py"), device=device, program=str(BUGS / f"{name}.py")))
    return program


def traced(tmp_path, name, device, fixed):
    program = _program(tmp_path, name, device)
    out = tmp_path / f"{name}_{device}_{fixed}.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(program), *(["--fixed"] if fixed else [])])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(out.read_text()), result.output


def runs_on_its_own(tmp_path, name, device, fixed) -> tuple[bool, str]:
    """Whether the program, with no trace, runs with `device` as torch's default (one that mixes CPU tensors of its
    own making, numpy's or a CPU generator's, with default-device ones does not: the program's, not the trace's);
    the last line it wrote to stderr."""
    program = _program(tmp_path, name, device)
    run = subprocess.run([sys.executable, str(program), *(["--fixed"] if fixed else [])], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    return run.returncode == 0, (run.stderr.strip().splitlines() or [""])[-1]


def summary(data):
    """What does not depend on the device: each call's api, step and shape and mask digest; each group's name and
    findings (code, severity)."""
    calls = [(c["api"], c["step_label"], c["shape"], c["mask"]) for c in data["calls"]]
    groups = [(g["name"], sorted((f["code"], f["severity"]) for f in g["findings"])) for g in data["groups"]]
    return calls, groups


@pytest.mark.parametrize("fixed", [False, True], ids=["bug", "fixed"])
@pytest.mark.parametrize("name", sorted(p.stem for p in BUGS.glob("*.py")))
def test_a_bug_run_on_cuda_is_traced_as_on_cpu(tmp_path, monkeypatch, name, fixed):
    """generate with a static cache compiles the model's forward itself on CUDA only (transformers 5.24,
    generation/utils.py _valid_auto_compile_criteria), whose calls trace counts but cannot read: both runs go eager,
    as trace's note advises (TORCHDYNAMO_DISABLE=1, read at each torch.compile). test_trace_compiled.py runs that
    compiled path itself. Both runs draw their random numbers on the CPU (cuda_draws.py): CUDA's generator, seeded
    alike, draws other numbers, and a program's masks may follow its draws (random lengths, ids, top-k)."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    status_gpu, on_gpu, said = traced(tmp_path, name, "cuda", fixed)
    if on_gpu["exit_status"] != 0:
        alone, error = runs_on_its_own(tmp_path, name, "cuda", fixed)
        if not alone:
            pytest.skip(f"the program does not run with CUDA as torch's default device, traced or not: {error}")
    assert on_gpu["exit_status"] == 0, said
    status_cpu, on_cpu, said_cpu = traced(tmp_path, name, "cpu", fixed)
    assert on_cpu["exit_status"] == 0, said_cpu
    assert on_gpu["calls"] and {c["device"].split(":")[0] for c in on_gpu["calls"]} == {"cuda"}
    assert (status_gpu, summary(on_gpu)) == (status_cpu, summary(on_cpu)), f"cuda:\n{said}\ncpu:\n{said_cpu}"
