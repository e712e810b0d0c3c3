"""inspect recognises masks by rebuilding them; convert writes every convention; hostile files run nothing."""

from __future__ import annotations

import json
import pickle
import shlex
import struct

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask
from typer.testing import CliRunner

from maskcli.cli import app

runner = CliRunner()


def ok(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


def report(path, *extra):
    return json.loads(ok(["inspect", str(path), "--json", *extra]).stdout)


def mask_of(command: str) -> list:
    """The keep mask a `maskcli show ...` command builds, read from its --json."""
    args = shlex.split(command)
    assert args[:2] == ["maskcli", "show"]
    return json.loads(ok([*args[1:], "--json"]).stdout)["mask"]


BUILTIN = [
    "causal --len 6",
    "tril --len 5 --diagonal 2",
    "padding --lengths 4,2",
    "prefill --offset 3 --len 2",
    "chunk --chunks 0,0,1,1,1,2",
    "window --len 8 --window 3",
    "prefix --len 6 --prefix 2",
    "document --chunks 0,0,1,1,1,2",
    "causal --lengths 5,3",
]


@pytest.mark.parametrize("convention", ["keep", "block", "additive", "min", "int"])
@pytest.mark.parametrize("args", BUILTIN)
def test_every_kind_in_every_convention_is_recognised(tmp_path, args, convention):
    original = json.loads(ok(["show", *args.split(), "--json"]).stdout)
    ok(["show", *args.split(), "--as", convention, "--save", str(tmp_path / "m.pt")])
    found = report(tmp_path / "m.pt")
    # tril(ones, D) read as keep and triu(ones, D + 1) read as block are the same cells: either name is right
    same = {"tril": {"tril", "triu"}}.get(original["kind"], {original["kind"]})
    assert found["convention"] == convention and found["structure"] in same
    assert mask_of(found["command"]) == original["mask"]


@pytest.mark.parametrize("suffix", [".npy", ".json"])
def test_other_file_formats_via_convert(tmp_path, suffix):
    ok(["show", "window", "--len", "6", "--window", "2", "--save", str(tmp_path / "m.pt")])
    ok(["convert", str(tmp_path / "m.pt"), "--to", "additive", "--out", str(tmp_path / f"m{suffix}")])
    found = report(tmp_path / f"m{suffix}")
    assert found["convention"] == "additive" and found["command"] == "maskcli show window --len 6 --window 2"


def test_masks_from_pytorch_and_hugging_face_style_code(tmp_path):
    from torch.nn.attention.bias import causal_lower_right

    torch.save(torch.nn.Transformer.generate_square_subsequent_mask(5), tmp_path / "square.pt")
    found = report(tmp_path / "square.pt")
    assert (found["convention"], found["command"]) == ("additive", "maskcli show causal --len 5")

    torch.save(causal_lower_right(3, 7)._materialize(), tmp_path / "lower_right.pt")
    found = report(tmp_path / "lower_right.pt")
    assert (found["convention"], found["command"]) == ("keep", "maskcli show prefill --offset 4 --len 3")

    keep = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    keep[1, :, :, 3:] = False  # batch row 1 has 3 real tokens
    eager = torch.zeros(2, 1, 5, 5).masked_fill(~keep, torch.finfo(torch.float32).min)
    np.save(tmp_path / "eager.npy", eager.numpy())
    found = report(tmp_path / "eager.npy")
    assert (found["convention"], found["command"]) == ("min", "maskcli show causal --len 5 --lengths 5,3")
    assert [f["code"] for f in found["findings"]] == ["sentinel-overflow", "sentinel-overflow"]

    torch.save(keep, tmp_path / "sdpa.pt")
    assert report(tmp_path / "sdpa.pt")["command"] == "maskcli show causal --len 5 --lengths 5,3"

    def packed(b, h, q, kv):
        return (q // 3 == kv // 3) & (kv <= q)

    torch.save(create_mask(packed, 1, 1, 6, 6, device="cpu"), tmp_path / "flex.pt")
    assert report(tmp_path / "flex.pt")["command"] == "maskcli show document --chunks 0,0,0,1,1,1"


def test_flipped_polarity_is_recognised_as_block(tmp_path):
    torch.save(~torch.ones(6, 6, dtype=torch.bool).tril(), tmp_path / "mha.pt")
    found = report(tmp_path / "mha.pt")
    assert found["convention"] == "block" and found["convention_sure"]
    assert any("MultiheadAttention attn_mask: yes" in line for line in found["apis"])
    assert any("pass ~mask" in line for line in found["apis"])  # SDPA would read it the wrong way round


def test_findings_fully_masked_off_by_one_and_3d_heads(tmp_path):
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    keep[2, 3] = True  # one query sees the next key
    keep[4] = False  # and one sees nothing
    torch.save(keep, tmp_path / "bug.pt")
    found = report(tmp_path / "bug.pt")
    assert found["structure"] is None
    messages = {f["code"]: f["message"] for f in found["findings"]}
    assert "query row 4 sees no key" in messages["fully-masked"]
    assert messages["sees-later"].startswith("query row 2 sees later keys while the others do not")

    torch.save(torch.ones(8, 4, 4).tril().bool(), tmp_path / "three.pt")
    found = report(tmp_path / "three.pt", "--heads", "8")
    assert "3d-heads" in [f["code"] for f in found["findings"]]
    assert "8 heads" in found["broadcast"] and "batch x heads" in found["broadcast"]


def test_inspect_renders_like_show(tmp_path):
    ok(["show", "causal", "--len", "3", "--save", str(tmp_path / "m.pt")])
    lines = [" ".join(line.split()) for line in ok(["inspect", str(tmp_path / "m.pt")]).stdout.splitlines()]
    assert "structure: causal — rebuild it with: maskcli show causal --len 3" in " ".join(lines)
    assert lines[-3:] == ["0 1 0 0", "1 1 1 0", "2 1 1 1"]


@pytest.mark.parametrize("target", ["keep", "block", "additive", "min", "int"])
@pytest.mark.parametrize("suffix", [".pt", ".npy", ".json"])
def test_convert_writes_each_convention(tmp_path, target, suffix):
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.save(~keep, tmp_path / "block.pt")
    out = tmp_path / f"out{suffix}"
    ok(["convert", str(tmp_path / "block.pt"), "--to", target, "--out", str(out), "--dtype", "float16"])
    if suffix == ".pt":
        got = torch.load(out, weights_only=True)
    elif suffix == ".npy":
        got = torch.from_numpy(np.load(out))
    else:
        got = torch.tensor([[float(x) for x in row] for row in json.loads(out.read_text())])
    expected = {
        "keep": keep,
        "block": ~keep,
        "additive": torch.zeros(4, 4).masked_fill(~keep, float("-inf")),
        "min": torch.zeros(4, 4).masked_fill(~keep, torch.finfo(torch.float16).min),
        "int": keep.long(),
    }[target]
    assert torch.equal(got.to(expected.dtype) if suffix == ".json" else got.to(expected.dtype), expected)
    if suffix != ".json" and target in ("additive", "min"):
        assert got.dtype == torch.float16


def test_convert_asks_for_from_when_polarity_is_unknowable(tmp_path):
    torch.save(torch.ones(3, 3, dtype=torch.bool), tmp_path / "all.pt")
    result = runner.invoke(app, ["convert", str(tmp_path / "all.pt"), "--to", "additive", "--out", str(tmp_path / "o.pt")])
    assert result.exit_code == 2 and "--from keep or --from block" in result.stderr
    assert not (tmp_path / "o.pt").exists()
    ok(["convert", str(tmp_path / "all.pt"), "--from", "block", "--to", "int", "--out", str(tmp_path / "o.pt")])
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True), torch.zeros(3, 3, dtype=torch.long))


class Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch exploited",))


def write_safetensors(path, name):
    raw = np.zeros((2, 2), dtype="<f4").tobytes()
    header = json.dumps({name: {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, len(raw)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)


def hostile(tmp_path):
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "corrupt.pt").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(Exploit()))
    torch.save({"mask": Exploit()}, tmp_path / "evil_zip.pt")
    torch.save(torch.zeros(2, 2, dtype=torch.complex64), tmp_path / "complex.pt")
    np.save(tmp_path / "strings.npy", np.array([["a", "b"], ["c", "d"]]))
    torch.save(torch.zeros(1, 1, 1, 2, 2, dtype=torch.bool), tmp_path / "five.pt")
    np.savez(tmp_path / "two.npz", first=np.zeros((2, 2)), second=np.ones((2, 2)))
    write_safetensors(tmp_path / "named.safetensors", "attention_mask")


HOSTILE = [
    (["inspect", "missing.pt"], "no such file"),
    (["inspect", "empty.npy"], "empty"),
    (["inspect", "corrupt.pt"], "corrupt.pt"),
    (["inspect", "evil.pt"], "nothing in it was run"),
    (["inspect", "evil_zip.pt"], "nothing in it was run"),
    (["inspect", "complex.pt"], "complex"),
    (["inspect", "strings.npy"], "<U1"),
    (["inspect", "five.pt"], "5 dimensions"),
    (["inspect", "two.npz"], "'first', 'second'"),
    (["inspect", "two.npz", "--key", "third"], "'first', 'second'"),
    (["inspect", "named.safetensors", "--key", "mask"], "'attention_mask'"),
    (["convert", "evil.pt", "--to", "keep", "--out", "o.pt"], "nothing in it was run"),
    (["convert", "five.pt", "--to", "keep", "--out", "o.txt"], "'.txt'"),
]


@pytest.mark.parametrize("args, quoted", HOSTILE, ids=[" ".join(a) for a, _ in HOSTILE])
def test_hostile_and_broken_files(tmp_path, monkeypatch, args, quoted):
    hostile(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.iterdir())
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maskcli: error:") and quoted in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert set(tmp_path.iterdir()) == before  # nothing ran, nothing was written
