"""trace on programs that run on a CUDA device: every reproduction in tests/data/bugs run with CUDA as torch's default
device is traced as on the CPU (the same masks, the same findings, the same exit status), and its calls say cuda.

Marked `cuda`, skipped where torch sees no CUDA device (`pytest -m cuda`).
"""

from __future__ import annotations

import json
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

ON = """import runpy, sys, torch
torch.set_default_device({device!r})
sys.argv = [{program!r}, *sys.argv[1:]]
runpy.run_path({program!r}, run_name="__main__")
"""


def traced(tmp_path, name, device, fixed):
    program = tmp_path / f"{name}_{device}.py"
    program.write_text(ON.format(device=device, program=str(BUGS / f"{name}.py")))
    out = tmp_path / f"{name}_{device}_{fixed}.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(program), *(["--fixed"] if fixed else [])])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    data = json.loads(out.read_text())
    assert data["exit_status"] == 0, result.output
    return result.exit_code, data


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
    compiled path itself."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    status_gpu, on_gpu = traced(tmp_path, name, "cuda", fixed)
    status_cpu, on_cpu = traced(tmp_path, name, "cpu", fixed)
    assert on_gpu["calls"] and {c["device"].split(":")[0] for c in on_gpu["calls"]} == {"cuda"}
    assert status_gpu == status_cpu
    assert summary(on_gpu) == summary(on_cpu)
