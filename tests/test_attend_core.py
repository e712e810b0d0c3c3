"""attend: stages against SDPA (math) and nn.MultiheadAttention, fills, findings, inputs, and the CLI."""

from __future__ import annotations

import json
import math
import pickle
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from typer.testing import CliRunner

from maskcli.attention import attend, fill_value
from maskcli.checks import run_findings
from maskcli.cli import app
from maskcli.masks import build
from maskcli.spec import make_spec

runner = CliRunner()

KINDS = [
    ("causal", dict(length=6)),
    ("tril", dict(length=5, diagonal=1)),
    ("triu", dict(length=5)),
    ("padding", dict(lengths="5,2")),
    ("prefill", dict(offset=3, length=2)),
    ("chunk", dict(chunks="0,0,1,1,2")),
    ("window", dict(length=7, window=3)),
    ("prefix", dict(length=6, prefix=2)),
    ("document", dict(chunks="0,0,1,1,1")),
    ("causal", dict(length=5, lengths="5,3")),
]


def random_qkv(spec, dim=8, heads=2, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.batch, heads)
    return (
        torch.randn(*shape, spec.q_len, dim, generator=generator, dtype=dtype),
        torch.randn(*shape, spec.k_len, dim, generator=generator, dtype=dtype),
        torch.randn(*shape, spec.k_len, dim, generator=generator, dtype=dtype),
    )


@pytest.mark.parametrize("kind, options", KINDS, ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in KINDS])
def test_every_stage_agrees_with_sdpa_math(kind, options):
    spec = make_spec(kind, heads=2, **options)
    keep = build(spec).materialize()
    q, k, v = random_qkv(spec)
    stages = attend(q, k, v, keep)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert (stages.output - expected).abs().max().item() <= 1e-6
    # the weights, written out independently
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    assert torch.allclose(stages.scores, torch.einsum("bhqd,bhkd->bhqk", q, k), atol=1e-6)
    assert torch.allclose(stages.weights, weights, atol=1e-6)
    assert bool(torch.isneginf(stages.masked[~keep.expand(stages.masked.shape)]).all())


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 10), offset=st.integers(0, 6), dim=st.integers(1, 6), scale=st.floats(0.05, 2.0))
def test_prefill_with_any_scale_agrees_with_sdpa(length, offset, dim, scale):
    spec = make_spec("prefill", offset=offset, length=length)
    keep = build(spec).materialize()
    q, k, v = random_qkv(spec, dim=dim, heads=1, seed=length * 31 + offset)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    assert (attend(q, k, v, keep, scale=scale).output - expected).abs().max().item() <= 1e-5


def test_matches_multihead_attention_with_the_same_projections():
    """The classic notebook comparison: same weights, block-convention attn_mask and key_padding_mask."""
    torch.manual_seed(0)
    batch, length, embed, heads = 2, 5, 8, 2
    x = torch.randn(batch, length, embed)
    mha = torch.nn.MultiheadAttention(embed, heads, bias=False, batch_first=True).eval()
    lengths = [5, 3]
    spec = make_spec("causal", length=length, lengths=",".join(map(str, lengths)), heads=heads)
    keep = build(spec).materialize()
    causal_block = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
    key_padding = torch.tensor([[j >= n for j in range(length)] for n in lengths])
    with torch.no_grad():
        out, weights = mha(x, x, x, attn_mask=causal_block, key_padding_mask=key_padding, average_attn_weights=False)
        w_q, w_k, w_v = mha.in_proj_weight.chunk(3)

        def split(t):
            return t.view(batch, length, heads, embed // heads).transpose(1, 2)

        stages = attend(split(x @ w_q.T), split(x @ w_k.T), split(x @ w_v.T), keep)
        merged = stages.output.transpose(1, 2).reshape(batch, length, embed) @ mha.out_proj.weight.T
    assert torch.allclose(stages.weights, weights, atol=1e-6)
    assert torch.allclose(merged, out, atol=1e-6)


def test_multiply_equals_minus_inf_except_on_fully_masked_rows():
    spec = make_spec("causal", length=4, lengths="4,0")
    keep = build(spec).materialize()
    q, k, v = random_qkv(spec)
    by_inf = attend(q, k, v, keep, fill="-inf")
    by_multiply = attend(q, k, v, keep, fill="multiply")
    assert torch.allclose(by_inf.weights[0], by_multiply.weights[0], atol=1e-6)
    assert bool(by_inf.weights[1].isnan().all()) and bool(by_multiply.weights[1].isnan().all())
    # -1e9 and finfo.min leave a fully masked row uniform over the keys it should not see
    for fill in ("-1e9", "min"):
        stages = attend(q, k, v, keep, fill=fill)
        assert torch.allclose(stages.weights[1], torch.full_like(stages.weights[1], 0.25))
        codes = [f.code for f in run_findings(stages, "causal")]
        assert codes == ["fully-masked"]
        assert "uniform" in run_findings(stages, "causal")[0].message


def test_fill_overflow_in_float16_is_found():
    assert fill_value("-1e9", torch.float16) == float("-inf")
    assert fill_value("-1e9", torch.float32) == -1e9
    spec = make_spec("padding", lengths="2,0")
    q, k, v = random_qkv(spec, dtype=torch.float16)
    stages = attend(q, k, v, build(spec).materialize(), fill="-1e9")
    codes = [f.code for f in run_findings(stages, "padding")]
    assert codes[0] == "fill-overflow" and "fully-masked" in codes
    clean = attend(*random_qkv(make_spec("causal", length=3)), build(make_spec("causal", length=3)).materialize())
    assert run_findings(clean, "causal") == []


def test_a_triu_read_as_keep_sees_later_keys():
    spec = make_spec("triu", length=3, means="keep")
    stages = attend(*random_qkv(spec), build(spec).materialize())
    findings = {f.code: f.message for f in run_findings(stages, "triu")}
    assert "sees-later" in findings and "--means" in findings["sees-later"]
    assert "fully-masked" in findings and "NaN" in findings["fully-masked"]


TUTORIAL_X = [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64], [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]]
TUTORIAL_WEIGHTS = [  # causal attention weights printed by the tutorial (seed 789, d_out 2)
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
    [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
    [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]


def test_tutorial_inputs_and_seed_reproduce_the_tutorial_weights():
    result = runner.invoke(app, ["attend", "causal", "--x", json.dumps(TUTORIAL_X), "--seed", "789", "--d-out", "2", "--json"])
    assert result.exit_code == 0, result.output
    weights = json.loads(result.stdout)["stages"]["weights"][0][0]
    assert [[round(w, 4) for w in row] for row in weights] == TUTORIAL_WEIGHTS


def test_json_writes_non_finite_values_as_strings():
    result = runner.invoke(app, ["attend", "padding", "--lengths", "2,0", "--json", "--dtype", "float64"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["device"] == "cpu" and data["dtype"] == "float64" and set(data["stages"]) == {"scores", "scaled", "masked", "weights", "output"}
    assert data["stages"]["masked"][1][0][0] == ["-inf", "-inf"]
    assert data["stages"]["weights"][1][0][0] == ["nan", "nan"]
    assert data["stages"]["masked"][0][0][0][0] not in ("nan", "inf", "-inf")
    assert [f["code"] for f in data["findings"]] == ["fully-masked"]


def save_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.mark.parametrize("fmt", ["pt", "npy", "safetensors", "json", "inline"])
@pytest.mark.parametrize("shape", [(4, 3), (2, 4, 3), (2, 2, 4, 3)])
def test_given_inputs_in_every_format_and_shape(tmp_path, fmt, shape):
    generator = torch.Generator().manual_seed(7)
    tensors = {name: torch.randn(*shape, generator=generator) for name in "qkv"}
    args = []
    for name, tensor in tensors.items():
        path = tmp_path / f"{name}.{fmt}"
        if fmt == "pt":
            torch.save(tensor, path)
        elif fmt == "npy":
            np.save(path, tensor.numpy())
        elif fmt == "safetensors":
            save_safetensors(path, {name: tensor})
        elif fmt == "json":
            path.write_text(json.dumps(tensor.tolist()))
        args += [f"--{name}", json.dumps(tensor.tolist()) if fmt == "inline" else str(path)]
    result = runner.invoke(app, ["attend", "causal", *args, "--json"])
    assert result.exit_code == 0, result.output
    four = [t.reshape((1,) * (4 - len(shape)) + shape) if len(shape) != 3 else t[:, None] for t in tensors.values()]
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*four, is_causal=True)
    got = torch.tensor(json.loads(result.stdout)["stages"]["output"])
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)


class Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch exploited",))


def bad_files(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "corrupt.npy").write_bytes(b"\x93NUMPY garbage")
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(Exploit()))
    torch.save({"q": Exploit()}, tmp_path / "evil_zip.pt")
    torch.save(torch.zeros(1, 1, 1, 4, 3), tmp_path / "five.pt")
    torch.save(torch.zeros(9, 3), tmp_path / "nine.pt")


BAD = [
    (["--q", "missing.pt", "--k", "missing.pt", "--v", "missing.pt"], "no such file"),
    (["--q", "empty.pt", "--k", "empty.pt", "--v", "empty.pt"], "empty"),
    (["--q", "corrupt.npy", "--k", "corrupt.npy", "--v", "corrupt.npy"], "corrupt.npy"),
    (["--q", "evil.pt", "--k", "evil.pt", "--v", "evil.pt"], "nothing in it was run"),
    (["--q", "evil_zip.pt", "--k", "evil_zip.pt", "--v", "evil_zip.pt"], "GLOBAL posix.system"),
    (["--q", "five.pt", "--k", "five.pt", "--v", "five.pt"], "[1, 1, 1, 4, 3]"),
    (["--q", "nine.pt", "--k", "nine.pt", "--v", "nine.pt", "--len", "4"], "query length"),
    (["--q", "nine.pt"], "--k, --v"),
    (["--x", "[[1, 2], [3]]"], "rectangular"),
    (["--device", "tpu"], "'tpu'"),
    (["--device", "cuda:7"], "available: cpu"),
    (["--dtype", "float8"], "'float8'"),
    (["--fill", "zero"], "'zero'"),
    (["--stages", "scores,logits"], "'logits'"),
    (["--dropout", "1.5"], "1.5"),
]


@pytest.mark.parametrize("args, quoted", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_inputs_are_one_line_and_run_nothing(tmp_path, monkeypatch, args, quoted):
    if torch.cuda.is_available() and "cuda:7" in args:
        pytest.skip("a machine with a GPU names other devices")
    bad_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["attend", "causal", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maskcli: error:") and quoted in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "exploited").exists()


def test_tables_mark_masked_cells():
    result = runner.invoke(app, ["attend", "causal", "--len", "3", "--stages", "masked,weights"])
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.split()) for line in result.stdout.splitlines()]
    assert "device cpu · dtype float32 · scale 0.353553 · fill: masked_fill -inf" in lines
    masked_row0 = next(line for line in lines if line.startswith("0 ") and "-inf×" in line)
    assert masked_row0.endswith("-inf× -inf×")
    weights_row0 = [line for line in lines if line.startswith("0 ")][1]
    assert weights_row0 == "0 1.0000 0.0000× 0.0000×"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_computes_there_and_agrees_with_cpu():
    results = {}
    for device in ("cpu", "cuda"):
        result = runner.invoke(app, ["attend", "window", "--len", "16", "--window", "4", "--heads", "2", "--device", device, "--json"])
        assert result.exit_code == 0, result.output
        results[device] = json.loads(result.stdout)
    assert results["cuda"]["device"].startswith("cuda")
    assert torch.allclose(torch.tensor(results["cuda"]["stages"]["output"]), torch.tensor(results["cpu"]["stages"]["output"]), atol=1e-5)
