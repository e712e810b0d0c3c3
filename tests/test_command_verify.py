"""verify: every kernel against an independent float64 computation, and what each does with fully masked rows."""

from __future__ import annotations

import json
from pathlib import Path
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from typer.testing import CliRunner

from maskcli.commands import app
from flags import from_flags
from maskcli.attention.verify import classify_masked_rows, verify

runner = CliRunner()

SPECS = [
    dict(kind="causal", length=6),
    dict(kind="tril", length=5, diagonal=1),
    dict(kind="triu", length=5),
    dict(kind="padding", lengths="4,0", length=5),  # a length-0 sequence: a whole batch row sees nothing
    dict(kind="prefill", offset=3, length=2),
    dict(kind="chunk", chunks="0,0,1,1,2"),
    dict(kind="window", length=7, window=3),
    dict(kind="prefix", length=6, prefix=2),
    dict(kind="document", chunks="0,0,1,1,1"),
    dict(kind="causal", length=5, lengths="5,3"),
    dict(kind="triu", length=4, means="keep"),  # the last row sees nothing
]


def reference_output(q, k, v, keep):
    """softmax(q kᵀ / sqrt(d), -inf where masked) v, in float64, written out here."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("options", SPECS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_every_backend_that_runs_agrees_with_an_independent_reference(options):
    spec = from_flags(options["kind"], **{key: value for key, value in options.items() if key != "kind"}, heads=2)
    mask = spec
    generator = torch.Generator().manual_seed(1)
    batch = spec.batch
    q = torch.randn(batch, 2, spec.frame.q_len, 8, generator=generator)
    k = torch.randn(batch, 2, spec.frame.k_len, 8, generator=generator)
    v = torch.randn(batch, 2, spec.frame.k_len, 8, generator=generator)
    results = {r.name: r for r in verify(mask, q, k, v, scale=None, atol=1e-5, repeat=1)}

    keep = mask.materialize()
    visible = keep.any(dim=-1)
    expected = reference_output(q, k, v, keep)
    for name in ("maskcli staged", "sdpa math", "nn.MultiheadAttention", "flex_attention"):
        assert results[name].status == "ok", (name, results[name].reason)
        assert results[name].max_diff <= 1e-5, name
    # The table's max |diff| is the visible-row difference, recomputed here for SDPA math.
    with sdpa_kernel(SDPBackend.MATH):
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).double()
    diff = (sdpa - expected).abs()[visible.expand(sdpa.shape[:-1])].max().item()
    assert results["sdpa math"].max_diff == pytest.approx(diff, abs=1e-9)

    if bool(visible.all()):
        assert all(r.masked_rows == "-" for r in results.values() if r.status == "ok")
    else:
        # What the fully masked rows hold is read off the backend's own output, independently.
        empty = ~visible
        rows = sdpa[empty.expand(sdpa.shape[:-1])]
        expected_kind = "NaN" if torch.isnan(rows).any() else "zero" if bool((rows.abs() < 1e-5).all()) else None
        if expected_kind is not None:
            assert results["sdpa math"].masked_rows == expected_kind
        assert results["maskcli staged"].masked_rows == "NaN"  # -inf fill: softmax of no finite score


def test_classify_masked_rows_names_each_behaviour():
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=torch.float64)
    empty = torch.tensor([[[True, False]]])
    unmasked = torch.tensor([[[[5.0, 6.0], [0.0, 0.0]]]], dtype=torch.float64)

    def out(row):
        return torch.tensor([[[row, [9.0, 9.0]]]], dtype=torch.float64)

    assert classify_masked_rows(out([0.0, 0.0]), empty, v, unmasked, 1e-6) == "zero"
    assert classify_masked_rows(out([math.nan, 0.0]), empty, v, unmasked, 1e-6) == "NaN"
    assert classify_masked_rows(out([2.0, 3.0]), empty, v, unmasked, 1e-6) == "mean of V"
    assert classify_masked_rows(out([5.0, 6.0]), empty, v, unmasked, 1e-6) == "the unmasked row"
    assert classify_masked_rows(out([7.0, 7.0]), empty, v, unmasked, 1e-6) == "other"
    assert classify_masked_rows(out([7.0, 7.0]), torch.zeros_like(empty), v, unmasked, 1e-6) == "-"


def test_mha_refuses_a_scale_it_cannot_apply():
    spec = from_flags("causal", length=4)
    q = k = v = torch.randn(1, 1, 4, 8)
    results = {r.name: r for r in verify(spec, q, k, v, scale=0.5, atol=1e-5, repeat=1)}
    assert results["nn.MultiheadAttention"].status == "refused"
    assert "1/sqrt(head_dim)" in results["nn.MultiheadAttention"].reason
    assert results["sdpa math"].status == "ok" and results["sdpa math"].max_diff <= 1e-5


def test_cli_json_table_and_strict():
    result = runner.invoke(app, ["verify", "padding", "--lengths", "3,0", "--len", "4", "--json", "--repeat", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["device"] == "cpu" and data["dtype"] == "float32" and data["shape"] == [2, 2, 4, 4]
    names = [row["backend"] for row in data["backends"]]
    assert names[:2] == ["maskcli staged", "sdpa math"] and "flex_attention" in names
    staged = data["backends"][0]
    assert staged["status"] == "ok" and staged["fully_masked_rows"] == "NaN" and staged["agrees"]

    ok = runner.invoke(app, ["verify", "causal", "--len", "4", "--strict", "--repeat", "1"])
    assert ok.exit_code == 0, ok.output
    assert "maskcli staged" in ok.stdout and "agrees" in ok.stdout
    # A tolerance of 0 cannot be met by float32 kernels that sum in another order.
    strict = runner.invoke(app, ["verify", "causal", "--len", "16", "--atol", "0", "--strict", "--repeat", "1"])
    assert strict.exit_code == 1, strict.output
    assert "DISAGREES" in strict.stdout


@pytest.mark.parametrize(
    "args, quoted",
    [
        (["verify", "causal", "--atol", "-1"], "-1"),
        (["verify", "causal", "--repeat", "0"], "0"),
        (["verify", "causal", "--device", "tpu"], "'tpu'"),
        (["verify", "nope"], "'nope'"),
    ],
)
def test_cli_bad_input_is_one_line(args, quoted):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maskcli: error:") and quoted in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args", [
    ["document(0,0,1,1,1,2,2,2) & window(2)"],
    ["causal | blocks(-1,-1,0,0,0,-1)"],
    ["local(3)", "--ids", "0,0,5,6,7,8,9,1"],
    ["window(3)", "--offset", "6", "--len", "2", "--kv-start", "3"],
    ["tree(-1,0,0,1)", "--offset", "3"],
    ["document(0,0,1,1;0,1,1,1) & local(2)", "--ids", "0,1,2,3", "--pad-id", "0"],  # one ids row, two label rows
    ["document(0,0,1,1;0,1,1,1)", "--lengths", "3"],
])
def test_expressions_agree_across_every_kernel_that_runs(args):
    result = runner.invoke(app, ["verify", *args, "--json", "--repeat", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ran = {row["backend"]: row for row in data["backends"] if row["status"] == "ok"}
    assert {"maskcli staged", "sdpa math", "nn.MultiheadAttention", "flex_attention"} <= set(ran)
    assert all(row["agrees"] for row in ran.values()), ran


def test_a_mask_mod_and_a_mask_file_agree_across_kernels(tmp_path):
    gym = str(Path(__file__).parent / "data" / "gym_masks.py")
    for args in (["--mask-mod", f"{gym}:packed_causal", "--len", "8"], ["--mask", str(tmp_path / "m.pt")]):
        torch.save(torch.nn.Transformer.generate_square_subsequent_mask(6), tmp_path / "m.pt")
        result = runner.invoke(app, ["verify", *args, "--json", "--repeat", "1"])
        assert result.exit_code == 0, result.output
        ran = [row for row in json.loads(result.stdout)["backends"] if row["status"] == "ok"]
        assert {"flex_attention", "nn.MultiheadAttention", "sdpa math"} <= {row["backend"] for row in ran}
        assert all(row["agrees"] for row in ran)


def test_the_header_uses_the_terminals_width_not_the_tables():
    result = runner.invoke(app, ["verify", "causal", "--len", "8"], env={"COLUMNS": "150", "MASKCLI_DEVICE": "cpu"})
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first.startswith("verify causal · shape (B=1, H=2, Lq=8, Lk=8, D=16) · cpu float32 · inputs: random")  # one line at 150


def test_at_60_columns_the_title_wraps_two_cells_in():
    """The title's further lines stood at column 0 ('Lq=5, Lk=5, D=16) · cpu float32 ...'), read as lines of their own."""
    result = runner.invoke(app, ["verify", "document(0,0,1,1,1) & window(2)"], env={"COLUMNS": "60"})
    assert result.exit_code == 0
    assert result.stdout.splitlines()[:4] == [
        "verify document(0,0,1,1,1) & window(2) · shape (B=1, H=2,",
        "  Lq=5, Lk=5, D=16) · cpu float32 · inputs: random,",
        "  torch.Generator().manual_seed(0)",
        "every query row sees at least one key",
    ]
