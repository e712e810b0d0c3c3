"""attend on a CUDA device: the same numbers as on cpu, computed there, and the output says so.

Every test here is marked `cuda` and skipped where torch sees no CUDA device
(run them alone with `pytest -m cuda`).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from typer.testing import CliRunner

from maskcli.attention.stages import attend
from maskcli.attention.findings import run_findings
from maskcli.commands import app
from flags import about, from_flags

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

runner = CliRunner()

KINDS = [
    ("causal", dict(length=9)),
    ("tril", dict(length=6, diagonal=1)),
    ("triu", dict(length=6)),
    ("padding", dict(lengths="6,3,0")),
    ("prefill", dict(offset=5, length=3)),
    ("chunk", dict(chunks="0,0,1,1,1,2")),
    ("window", dict(length=8, window=3)),
    ("prefix", dict(length=7, prefix=3)),
    ("document", dict(chunks="0,0,0,1,1,2")),
    ("causal", dict(length=6, lengths="6,4")),
]


def spelled(nested):
    table = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

    def convert(item):
        return [convert(x) for x in item] if isinstance(item, list) else table.get(item, item)

    return torch.tensor(convert(nested), dtype=torch.float64)


def same(a, b, atol):
    """Equal within atol where finite, NaN where the other is NaN, and the same infinities."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    finite = torch.isfinite(a) & torch.isfinite(b)
    assert torch.equal(a[~finite & ~torch.isnan(a)], b[~finite & ~torch.isnan(b)])
    assert (a[finite] - b[finite]).abs().max().item() <= atol if finite.any() else True


@pytest.mark.parametrize("kind, options", KINDS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(KINDS)])
@pytest.mark.parametrize("fill", ["-inf", "min", "multiply"])
def test_every_stage_on_cuda_equals_cpu(kind, options, fill):
    spec = from_flags(kind, heads=2, **options)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(spec.batch, 2, spec.frame.q_len, 16, generator=generator)
    k = torch.randn(spec.batch, 2, spec.frame.k_len, 16, generator=generator)
    v = torch.randn(spec.batch, 2, spec.frame.k_len, 16, generator=generator)
    on_cpu = attend(q, k, v, spec.materialize("cpu"), fill=fill)
    device = torch.device("cuda:0")
    keep = spec.materialize(device)
    assert keep.device.type == "cuda"
    on_cuda = attend(q.to(device), k.to(device), v.to(device), keep, fill=fill)
    for name in ("scores", "scaled", "masked", "weights", "output"):
        stage = on_cuda.stage(name)
        assert stage.device.type == "cuda" and stage.dtype == torch.float32, name
        same(stage, on_cpu.stage(name), 1e-5)
    assert [f.code for f in run_findings(on_cuda, spec)] == [f.code for f in run_findings(on_cpu, spec)]
    # and against SDPA's math backend on the GPU, on rows that see a key
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), attn_mask=keep)
    rows = keep.expand(on_cuda.weights.shape).any(dim=-1)
    if rows.any():
        assert (on_cuda.output - expected)[rows].abs().max().item() <= 1e-5


def test_minus_1e9_overflows_float16_on_cuda_too():
    spec = from_flags("padding", lengths="3,0")
    device = torch.device("cuda")
    q = torch.randn(2, 1, 3, 8, device=device, dtype=torch.float16)
    stages = attend(q, q, q, spec.materialize(device), fill="-1e9")
    assert bool(torch.isneginf(stages.masked[1]).all()) and bool(torch.isnan(stages.weights[1]).all())
    assert [f.code for f in run_findings(stages, about("padding"))] == ["fill-overflow", "fully-masked"]


def test_dropout_on_cuda_is_seeded():
    spec = from_flags("causal", length=8)
    device = torch.device("cuda")
    keep = spec.materialize(device)
    q = torch.randn(1, 1, 8, 4, device=device)
    first = attend(q, q, q, keep, dropout=0.3, seed=4)
    again = attend(q, q, q, keep, dropout=0.3, seed=4)
    assert torch.equal(first.weights, again.weights)
    # and they are what nn.Dropout drops on this device after torch.manual_seed
    plain = attend(q, q, q, keep)
    torch.manual_seed(4)
    assert torch.equal(first.weights, torch.nn.Dropout(0.3)(plain.weights))


def invoke_json(args):
    result = runner.invoke(app, ["attend", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("device, named", [("cuda", ("cuda", "cuda:0")), ("cuda:0", ("cuda:0",)), ("auto", ("cuda", "cuda:0"))])
def test_cli_on_cuda_names_the_device_and_matches_cpu(device, named):
    args = ["padding", "--lengths", "5,0", "--heads", 2, "--head-dim", 16, "--seed", 3]
    on_gpu = invoke_json([*args, "--device", device])
    on_cpu = invoke_json([*args, "--device", "cpu"])
    assert on_gpu["device"] in named and on_cpu["device"] == "cpu"
    assert on_gpu["dtype"] == "float32" and on_gpu["mask"] == on_cpu["mask"]
    for name in ("scores", "scaled", "masked", "weights", "output"):
        same(spelled(on_gpu["stages"][name]), spelled(on_cpu["stages"][name]), 1e-5)
    assert [f["code"] for f in on_gpu["findings"]] == ["fully-masked"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_cli_on_cuda_in_each_dtype(dtype):
    data = invoke_json(["causal", "--len", 6, "--device", "cuda", "--dtype", dtype])
    assert data["dtype"] == dtype and data["device"].startswith("cuda")
    reference = invoke_json(["causal", "--len", 6, "--device", "cpu", "--dtype", "float64"])
    tolerance = {"float16": 1e-2, "bfloat16": 4e-2, "float64": 1e-12}[dtype]
    same(spelled(data["stages"]["weights"]), spelled(reference["stages"]["weights"]), tolerance)


def test_cli_tables_and_figure_on_cuda(tmp_path):
    png = tmp_path / "cuda.png"
    result = runner.invoke(app, ["attend", "causal", "--len", 4, "--device", "cuda", "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert "device cuda" in result.stdout and png.stat().st_size > 0
    bad = runner.invoke(app, ["attend", "causal", "--len", 4, "--device", f"cuda:{torch.cuda.device_count()}"])
    assert bad.exit_code == 2 and bad.stderr.startswith("maskcli: error: ") and "available: cpu, cuda" in bad.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_attend_json_on_cuda_agrees_with_cpu():
    results = {}
    for device in ("cpu", "cuda"):
        result = runner.invoke(app, ["attend", "window", "--len", "16", "--window", "4", "--heads", "2", "--device", device, "--json"])
        assert result.exit_code == 0, result.output
        results[device] = json.loads(result.stdout)
    assert results["cuda"]["device"].startswith("cuda")
    assert torch.allclose(torch.tensor(results["cuda"]["stages"]["output"]), torch.tensor(results["cpu"]["stages"]["output"]), atol=1e-5)
