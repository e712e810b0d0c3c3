"""convert: every convention in every format and dtype, checked against torch.tril and the attention kernels themselves."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()
CAUSAL = torch.ones(4, 4, dtype=torch.bool).tril()


def ok(args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def fails(args, quoted: str):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maskcli: error: ") and quoted in lines[0], result.stderr
    assert "Traceback" not in result.output
    return result


def read(path) -> torch.Tensor:
    """Read a converted file back without maskcli: torch.load, numpy.load, or json with "-inf" spelt as a string."""
    if path.suffix == ".pt":
        return torch.load(path, weights_only=True)
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path, allow_pickle=False))
    data = json.loads(path.read_text(), parse_constant=float)

    def number(x):
        return [number(i) for i in x] if isinstance(x, list) else float(x) if isinstance(x, str) else x

    return torch.tensor(number(data))


def reference(keep: torch.Tensor, convention: str, dtype=torch.float32) -> torch.Tensor:
    return {
        "keep": keep,
        "block": ~keep,
        "additive": torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf")),
        "min": torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min),
        "int": keep.long(),
    }[convention]


SOURCES = {  # the same causal mask as code writes it in each convention
    "keep": lambda: CAUSAL,
    "block": lambda: torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1),
    "additive": lambda: torch.nn.Transformer.generate_square_subsequent_mask(4),
    "min": lambda: torch.zeros(4, 4).masked_fill(~CAUSAL, torch.finfo(torch.float32).min),
    "int": lambda: torch.tril(torch.ones(4, 4, dtype=torch.long)),
}


@pytest.mark.parametrize("suffix", [".pt", ".npy", ".json"])
@pytest.mark.parametrize("target", ["keep", "block", "additive", "min", "int"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_every_convention_to_every_convention(tmp_path, source, target, suffix):
    torch.save(SOURCES[source](), tmp_path / "in.pt")
    out = tmp_path / f"out{suffix}"
    result = ok(["convert", tmp_path / "in.pt", "--to", target, "--out", out])
    assert f"wrote {out}: {source} -> {target}" in result.stderr
    got, expected = read(out), reference(CAUSAL, target)
    if suffix == ".json":  # JSON keeps values, not dtypes
        assert torch.equal(got.to(expected.dtype), expected)
    else:
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "float32"])
@pytest.mark.parametrize("target", ["additive", "min"])
def test_float_dtypes(tmp_path, target, dtype):
    torch.save(CAUSAL, tmp_path / "in.pt")
    ok(["convert", tmp_path / "in.pt", "--to", target, "--dtype", dtype, "--out", tmp_path / "out.pt"])
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    torch_dtype = getattr(torch, dtype)
    assert got.dtype == torch_dtype and torch.equal(got, reference(CAUSAL, target, torch_dtype))
    if target == "min":
        assert got.min().item() == torch.finfo(torch_dtype).min  # the dtype's own min: no overflow to -inf


def test_bfloat16_cannot_go_to_npy_and_nothing_is_written(tmp_path):
    torch.save(CAUSAL, tmp_path / "in.pt")
    fails(["convert", tmp_path / "in.pt", "--to", "min", "--dtype", "bfloat16", "--out", tmp_path / "out.npy"], "bfloat16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_dtype_for_a_bool_target_is_warned_about_not_silently_ignored(tmp_path):
    torch.save(CAUSAL, tmp_path / "in.pt")
    result = ok(["convert", tmp_path / "in.pt", "--to", "keep", "--dtype", "float16", "--out", tmp_path / "out.pt"])
    assert "maskcli: warning: --dtype float16 is for --to additive or min; --to keep is written as bool" in result.stderr
    assert torch.load(tmp_path / "out.pt", weights_only=True).dtype == torch.bool


def test_shape_is_kept(tmp_path):
    keep = CAUSAL[None, None].repeat(2, 1, 1, 1)
    keep[1, :, :, 3:] = False
    torch.save(torch.zeros(2, 1, 4, 4).masked_fill(~keep, torch.finfo(torch.float32).min), tmp_path / "hf.pt")
    ok(["convert", tmp_path / "hf.pt", "--to", "keep", "--out", tmp_path / "out.pt"])
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True), keep)


def test_json_output_reads_back_in_inspect(tmp_path):
    torch.save(SOURCES["block"](), tmp_path / "in.pt")
    ok(["convert", tmp_path / "in.pt", "--to", "additive", "--out", tmp_path / "out.json"])
    assert json.loads((tmp_path / "out.json").read_text())[0] == [0.0, "-inf", "-inf", "-inf"]
    found = json.loads(ok(["inspect", tmp_path / "out.json", "--json"]).stdout)
    assert (found["convention"], found["command"]) == ("additive", "maskcli show causal --len 4")


def test_key_padding_mask_round_trip_and_the_sdpa_hint(tmp_path):
    torch.save(torch.tensor([[False, False, False, True], [False, False, True, True]]), tmp_path / "kpm.pt")
    # right-padded block or left-padded keep: the cells alone cannot say, so convert asks
    fails(["convert", tmp_path / "kpm.pt", "--to", "additive", "--out", tmp_path / "kpm.json"], "--from keep or --from block")
    ok(["convert", tmp_path / "kpm.pt", "--from", "block", "--to", "additive", "--out", tmp_path / "kpm.json"])
    found = json.loads(ok(["inspect", tmp_path / "kpm.json", "--json"]).stdout)
    assert (found["convention"], found["reading"], found["command"]) == ("additive", "key padding [B, S]", "maskcli show padding --len 4 --lengths 3,2")
    hint = found["apis"][0]
    assert hint.endswith("pass mask[:, None, None, :]")
    # the hint is right: SDPA with it equals nn.MultiheadAttention with the original key_padding_mask
    mask = read(tmp_path / "kpm.json")
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    mha = torch.nn.MultiheadAttention(8, 1, batch_first=True, bias=False)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(8).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(8))
    expected, _ = mha(x, x, x, key_padding_mask=torch.load(tmp_path / "kpm.pt", weights_only=True), need_weights=False)
    heads = x[:, None]  # (B, 1, L, E): one head, so the [B, 1, 1, S] mask broadcasts over queries
    assert torch.allclose(F.scaled_dot_product_attention(heads, heads, heads, attn_mask=mask[:, None, None, :])[:, 0], expected, atol=1e-6)


def test_converted_masks_give_the_same_attention(tmp_path):
    """nn.MultiheadAttention with the block file, SDPA with each converted file: one output."""
    torch.save(torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1), tmp_path / "mha.pt")
    torch.manual_seed(0)
    x = torch.randn(1, 5, 8)
    mha = torch.nn.MultiheadAttention(8, 1, batch_first=True, bias=False)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(8).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(8))
    expected, _ = mha(x, x, x, attn_mask=torch.load(tmp_path / "mha.pt", weights_only=True), need_weights=False)
    for target in ("keep", "additive", "min"):
        ok(["convert", tmp_path / "mha.pt", "--to", target, "--out", tmp_path / f"{target}.pt"])
        mask = torch.load(tmp_path / f"{target}.pt", weights_only=True)
        assert torch.allclose(F.scaled_dot_product_attention(x, x, x, attn_mask=mask), expected, atol=1e-6), target


def test_ones_mean_masked_in_a_triu_ones_mask(tmp_path):
    torch.save(torch.triu(torch.ones(4, 4), diagonal=1), tmp_path / "in.pt")  # used as masked_fill(mask.bool(), -inf)
    result = ok(["convert", tmp_path / "in.pt", "--to", "keep", "--out", tmp_path / "out.pt"])
    assert "int, 1 = masked -> keep" in result.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True), CAUSAL)


def test_hugging_face_attention_mask_to_key_padding_mask(tmp_path):
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    torch.save(attention_mask, tmp_path / "am.pt")
    ok(["convert", tmp_path / "am.pt", "--to", "block", "--out", tmp_path / "kpm.pt"])
    assert torch.equal(torch.load(tmp_path / "kpm.pt", weights_only=True), attention_mask == 0)


def test_from_is_needed_where_polarity_cannot_be_told(tmp_path):
    torch.save(torch.zeros(2, 5, dtype=torch.bool), tmp_path / "kpm.pt")  # a key_padding_mask with no padding
    fails(["convert", tmp_path / "kpm.pt", "--to", "additive", "--out", tmp_path / "o.pt"], "--from keep or --from block")
    assert not (tmp_path / "o.pt").exists()
    ok(["convert", tmp_path / "kpm.pt", "--from", "block", "--to", "additive", "--out", tmp_path / "o.pt"])
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True), torch.zeros(2, 5))
    ok(["convert", tmp_path / "kpm.pt", "--from", "keep", "--to", "int", "--out", tmp_path / "o.pt"])
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True), torch.zeros(2, 5, dtype=torch.long))


def test_from_overrides_the_inferred_polarity(tmp_path):
    torch.save(CAUSAL, tmp_path / "in.pt")
    ok(["convert", tmp_path / "in.pt", "--from", "block", "--to", "keep", "--out", tmp_path / "o.pt"])
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True), ~CAUSAL)


class Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch exploited",))


def test_refusals(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save(CAUSAL, "causal.pt")
    torch.save(torch.tensor([[0.0, -1.0], [-0.5, 0.0]]), "bias.pt")
    torch.save(SOURCES["additive"](), "additive.pt")
    torch.save(torch.zeros(1, 1, 1, 1, 2, 2), "five.pt")
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(Exploit()))
    before = set(tmp_path.iterdir())
    fails(["convert", "bias.pt", "--to", "keep", "--out", "o.pt"], "not a mask but an additive bias")
    fails(["convert", "additive.pt", "--from", "block", "--to", "keep", "--out", "o.pt"], "--from is for bool and 0/1 masks")
    fails(["convert", "causal.pt", "--to", "sideways", "--out", "o.pt"], "unknown --to convention 'sideways'")
    fails(["convert", "causal.pt", "--to", "min", "--dtype", "float8", "--out", "o.pt"], "unknown --dtype 'float8'")
    fails(["convert", "causal.pt", "--from", "additive", "--to", "keep", "--out", "o.pt"], "unknown --from convention 'additive'")
    fails(["convert", "causal.pt", "--to", "keep", "--out", "o.safetensors"], "unknown extension '.safetensors'")
    fails(["convert", "causal.pt", "--to", "keep", "--out", "no/such/dir/o.pt"], "does not exist")
    fails(["convert", "causal.pt", "--to", "keep", "--out", "."], "unknown extension")
    fails(["convert", "missing.pt", "--to", "keep", "--out", "o.pt"], "no such file")
    fails(["convert", "five.pt", "--to", "keep", "--out", "o.pt"], "6 dimensions")
    fails(["convert", "evil.pt", "--to", "keep", "--out", "o.pt"], "nothing in it was run")
    assert set(tmp_path.iterdir()) == before and not (tmp_path / "exploited").exists()


def test_out_pth_is_written_by_torch_save(tmp_path):
    """hunt 10: `--out o.pth` was refused ("unknown extension '.pth'"), though .pth is read as a .pt file."""
    torch.save(CAUSAL, tmp_path / "in.pt")
    result = runner.invoke(app, ["convert", str(tmp_path / "in.pt"), "--to", "block", "--out", str(tmp_path / "o.pth")])
    assert result.exit_code == 0, result.output
    assert torch.equal(torch.load(tmp_path / "o.pth", weights_only=True), ~CAUSAL.bool())


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    torch.save(CAUSAL, tmp_path / "in.pt")
    real_save = torch.save

    def half_then_fail(obj, path, *args, **kwargs):
        with open(path, "wb") as handle:
            handle.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_then_fail)
    fails(["convert", tmp_path / "in.pt", "--to", "keep", "--out", tmp_path / "out.pt"], "No space left on device")
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]  # neither out.pt nor a temporary file


def test_help_ends_with_examples():
    result = ok(["convert", "--help"])
    assert "maskcli convert mha_mask.pt --to keep --out sdpa_mask.pt" in " ".join(result.stdout.split())


def test_json_ends_with_a_newline(tmp_path):
    torch.save(torch.tril(torch.ones(2, 2, dtype=torch.bool)), tmp_path / "m.pt")
    ok(["convert", str(tmp_path / "m.pt"), "--to", "int", "--out", str(tmp_path / "m.json")])
    assert (tmp_path / "m.json").read_text() == "[[1, 0], [1, 1]]\n"
